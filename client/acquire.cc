// Client's acquires: on the fast path where it can answer, else by the daemon, across restarts.
#include <grpcpp/client_context.h>

#include <algorithm>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/calls.h"
#include "client/cancel.h"
#include "client/client_access.h"
#include "client/client_core.h"
#include "client/fast_path.h"
#include "client/lease.h"
#include "client/public_status.h"
#include "common/tensor/grpc_status.h"
#include "common/tensor/name.h"
#include "tensorshm/client.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {
namespace {

// `cancel` (may be null) ends a wait with CANCELLED. `local_only`: answer from the fast path or
// not at all (UNAVAILABLE where only the daemon could), with no call: a wait (timeout above zero)
// is on the fast path's futex alone.
absl::StatusOr<std::unique_ptr<Lease>> AcquireLease(const std::shared_ptr<ClientCore>& core,
                                                    std::string_view name, absl::Duration timeout,
                                                    ReadySync sync, CancelState* cancel,
                                                    bool local_only = false) {
  if (absl::Status s = core->CheckProcess(); !s.ok()) return s;
  if (absl::Status s = ValidateName(View(name)); !s.ok()) return s;
  if (timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout = ", absl::FormatDuration(timeout), ": must be >= 0"));
  }
  // The fast path answers from shared memory, and waits on the index's futex word; whatever it
  // cannot answer goes to the daemon with the time that is left.
  if (std::shared_ptr<FastPath> fast = core->fast_path(); fast != nullptr) {
    const absl::Time deadline =
        timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
    // Registered for the loop: Cancel wakes the futex sleep (a wake-up lost just before the
    // sleep begins costs at most one sleep, kLongestSleep in fast_path.cc).
    ScopedWait waiting(timeout == absl::ZeroDuration() ? nullptr : cancel,
                       CancelState::Wait{.fast = fast.get()});
    const std::string what = absl::StrCat("name = \"", View(name), "\"");
    if (!waiting.registered()) return Cancelled(what);
    while (true) {
      const uint32_t seen = fast->publishes();
      FastPath::Leased leased;
      const FastPath::Outcome outcome = fast->TryAcquire(name, &leased);
      if (outcome == FastPath::Outcome::kLeased) {
        absl::StatusOr<std::unique_ptr<Lease>> lease = MakePageLease(core, fast, leased);
        // A segment that cannot be mapped as the record says: the daemon answers instead.
        if (!lease.ok()) break;
        if (absl::Status s = WaitLeaseReady(**lease, sync); !s.ok()) {
          (*lease)->GiveBack();
          return s;
        }
        return lease;
      }
      if (outcome == FastPath::Outcome::kFallback) break;
      if (timeout == absl::ZeroDuration()) {
        return absl::NotFoundError(absl::StrCat("name = \"", View(name), "\": not published"));
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "name = \"", View(name), "\": not published within ", absl::FormatDuration(timeout)));
      }
      if (absl::Status s = core->CheckProcess(); !s.ok()) return s;
      if (cancel != nullptr && cancel->cancelled()) return Cancelled(what);
      fast->WaitForPublish(seen, deadline - now);
    }
    if (timeout != absl::InfiniteDuration()) {
      timeout = std::max(absl::ZeroDuration(), deadline - absl::Now());
    }
  }
  if (local_only) {
    return absl::UnavailableError(absl::StrCat(
        "name = \"", View(name), "\": the fast path cannot answer; ask the daemon (Acquire)"));
  }
  v1::ChannelRequest call;
  v1::AcquireRequest& request = *call.mutable_acquire();
  request.set_name(std::string(name));
  // The daemon settles a call whose answer this client does not take (a cancel or deadline
  // crossing its OK): it gives the lease back when told the id.
  const uint64_t request_id = core->NextRequestId();
  request.set_request_id(request_id);
  request.set_wait_ms(timeout == absl::InfiniteDuration()
                          ? -1
                          : absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1))));
  const std::string what = absl::StrCat("name = \"", View(name), "\"");
  CancelState* const cancellable = timeout == absl::ZeroDuration() ? nullptr : cancel;
  v1::AcquireResponse response;
  // Over the memory channel, where a wait holds up none of this client's other calls; by the
  // gRPC Acquire only when the channel cannot be had.
  const std::string session = core->session_id();
  absl::StatusOr<v1::ChannelResponse> answer = core->Exchange(call, timeout, cancellable);
  if (answer.ok()) {
    response = std::move(*answer->mutable_acquired());
  } else if (!ChannelNotHad(answer.status())) {
    const absl::Status& s = answer.status();
    if (SentWithoutAnswer(s)) core->QueueSettle(session, request_id);
    if (absl::IsCancelled(s) && cancel != nullptr && cancel->cancelled()) return Cancelled(what);
    return s;
  } else {
    grpc::ClientContext context;
    // The call's own deadline leaves room for the daemon to answer DEADLINE_EXCEEDED itself.
    const std::string rpc_session = core->PrepareContext(
        context, timeout == absl::InfiniteDuration() ? timeout : timeout + kCallTimeout);
    ScopedWait waiting(cancellable, CancelState::Wait{.context = &context});
    if (!waiting.registered()) return Cancelled(what);
    absl::Status s = FromGrpcStatus(core->stub()->Acquire(&context, request, &response));
    if (!s.ok() && MayHaveBeenGranted(s, context)) core->QueueSettle(rpc_session, request_id);
    if (absl::IsCancelled(s) && cancel != nullptr && cancel->cancelled()) return Cancelled(what);
    if (!s.ok()) return s;
  }
  absl::StatusOr<std::unique_ptr<Lease>> lease = MakeLease(core, response);
  if (!lease.ok()) return lease.status();
  if (absl::Status s = WaitLeaseReady(**lease, sync); !s.ok()) {
    (*lease)->GiveBack();
    return s;
  }
  return lease;
}

// AcquireLease, across a daemon restart (ClientCore::CallAcrossRestart): each attempt waits for a
// publish for what is left of `timeout`.
absl::StatusOr<std::unique_ptr<Lease>> AcquireAcrossRestart(const std::shared_ptr<ClientCore>& core,
                                                            std::string_view name,
                                                            absl::Duration timeout, ReadySync sync,
                                                            CancelState* cancel) {
  const absl::Time start = absl::Now();
  return core->CallAcrossRestart(
      absl::StrCat("acquire of name = \"", View(name), "\""), ClientCore::RestartDeadline(timeout),
      /*repeatable=*/true, cancel, [&] {
        absl::Duration left = timeout;
        if (timeout != absl::InfiniteDuration() && timeout > absl::ZeroDuration()) {
          left = std::max(absl::ZeroDuration(), start + timeout - absl::Now());
        }
        return AcquireLease(core, name, left, sync, cancel);
      });
}

}  // namespace

StatusOr<DLManagedTensorVersioned*> Client::Acquire(std::string_view name, Duration timeout,
                                                    ReadySync sync) {
  absl::StatusOr<std::unique_ptr<Lease>> lease =
      AcquireAcrossRestart(core_, name, ToAbsl(timeout), sync, nullptr);
  if (!lease.ok()) return ToPublic(lease.status());
  return HandOut(*std::move(lease));
}

StatusOr<DLManagedTensorVersioned*> Client::Acquire(std::string_view name, Duration timeout,
                                                    ReadySync sync, const WaitCanceller& cancel) {
  absl::StatusOr<std::unique_ptr<Lease>> lease =
      AcquireAcrossRestart(core_, name, ToAbsl(timeout), sync, ClientAccess::State(cancel));
  if (!lease.ok()) return ToPublic(lease.status());
  return HandOut(*std::move(lease));
}

StatusOr<DLManagedTensorVersioned*> Client::TryAcquireLocal(std::string_view name, Duration wait) {
  absl::StatusOr<std::unique_ptr<Lease>> lease =
      AcquireLease(core_, name, ToAbsl(wait), ReadySync::None(), nullptr, /*local_only=*/true);
  if (absl::IsDeadlineExceeded(lease.status())) {
    // As the contract says: not published.
    return Status(StatusCode::kNotFound, std::string(lease.status().message()));
  }
  if (!lease.ok()) return ToPublic(lease.status());
  return HandOut(*std::move(lease));
}

StatusOr<DLManagedTensor*> Client::AcquireLegacy(std::string_view name, Duration timeout,
                                                 ReadySync sync) {
  absl::StatusOr<std::unique_ptr<Lease>> lease =
      AcquireAcrossRestart(core_, name, ToAbsl(timeout), sync, nullptr);
  if (!lease.ok()) return ToPublic(lease.status());
  return HandOutLegacy(*std::move(lease));
}

}  // namespace tensorshm
