// Creates: one that does not wait for memory (answered now, or by GrowPools once its pool has
// grown), and one that may (CreateQueue). The create itself is Creator's.
#include <optional>
#include <string>
#include <utility>

#include "server/core/store.h"

namespace tensorshm {

absl::Status Store::Create(const PeerCredentials& peer, const std::optional<std::string>& token,
                           CreateCall* call, bool* answered_later) {
  Lock lock(this);
  absl::StatusOr<tensorshm::Session*> caller = CallerSession(token, peer);
  if (!caller.ok()) return caller.status();
  tensorshm::Session& session = **caller;
  if (session.TakeSettled(call->order.request_id)) {
    return absl::CancelledError("create: settled (cancelled) by the client before it arrived");
  }
  SegmentGrowth growth;
  absl::StatusOr<Created> created = creator_.Create(session, call->order, &growth);
  if (!growth.needed() && !growth.busy()) {
    if (!created.ok()) return created.status();
    call->created = *std::move(created);
    return leasing_.KeepCreated(session.token, absl::OkStatus(), call->order.request_id,
                                call->created);
  }
  // A pool must grow first: not on this thread, one of the transport's few.
  if (shutting_down_) return absl::UnavailableError("tensorshmd is stopping");
  growth_.Push({call, session.token});
  *answered_later = true;
  return absl::OkStatus();
}

absl::Status Store::CreateWaiting(const PeerCredentials& peer,
                                  const std::optional<std::string>& token, CreateWait* waiter,
                                  bool* answered_later) {
  Lock lock(this);
  absl::StatusOr<tensorshm::Session*> caller = CallerSession(token, peer);
  if (!caller.ok()) return caller.status();
  return create_queue_.Wait(**caller, waiter, shutting_down_, answered_later);
}

void Store::CancelCreate(CreateWait* waiter) {
  Lock lock(this);
  create_queue_.Cancel(waiter);
}

void Store::CreateWaiterDone(CreateWait* waiter, bool cancelled) {
  Lock lock(this);
  create_queue_.Done(waiter, cancelled);
}

}  // namespace tensorshm
