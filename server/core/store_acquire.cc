// Acquires (those that wait for a publish are AcquireWaits'), the Store's end
// (BeginShutdown) and its waiters' timer (ExpireWaiters). Calls answered later are answered with
// mu_ released (UnlockAndFinish), since a transport may re-enter the Store from an answer (gRPC
// may run a reactor's OnCancel and OnDone inline).
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "common/tensor/name.h"
#include "server/core/store.h"
#include "server/ops/log.h"

namespace tensorshm {

absl::Status Store::Acquire(const PeerCredentials& peer, const std::optional<std::string>& token,
                            AcquireWait* waiter, bool* answered_later) {
  if (absl::Status s = ValidateName(waiter->name); !s.ok()) return s;
  Lock lock(this);
  absl::StatusOr<tensorshm::Session*> caller = CallerSession(token, peer);
  if (!caller.ok()) return caller.status();
  return acquire_waits_.Acquire(**caller, waiter, shutting_down_, answered_later);
}

void Store::UnlockAndFinish() {
  // Memory freed (or a waiting create gone) under this lock: the waiting creates try again.
  if (create_queue_.RetryDue()) create_queue_.Retry();
  std::vector<Answers::Queued> answers = answers_.Take();
  mu_.unlock();
  for (Answers::Queued& answer : answers) {
    answer.call->Answer(std::move(answer.status), answer.granted);
  }
}

void Store::CancelWaiter(AcquireWait* waiter) {
  Lock lock(this);
  acquire_waits_.Cancel(waiter);
}

void Store::WaiterDone(AcquireWait* waiter, bool cancelled) {
  Lock lock(this);
  acquire_waits_.Done(waiter, cancelled);
}

void Store::BeginShutdown() {
  Lock lock(this);
  shutting_down_ = true;
  catalog_->mutable_index().StopServing();
  const absl::Status stopping = absl::UnavailableError("tensorshmd is stopping");
  acquire_waits_.FailAll(stopping);
  create_queue_.FailAll(stopping);
  growth_.Stop();
  stopping_.SignalAll();
  next_deadline_.SignalAll();
}

void Store::ExpireWaiters() {
  while (true) {
    Lock lock(this);
    if (shutting_down_) return;
    const absl::Time now = absl::Now();
    bool expired = acquire_waits_.Expire(now);
    if (create_queue_.Expire(now)) expired = true;
    if (expired) continue;  // finished as `lock` goes, then the queue is looked at again
    const absl::Time next = std::min(create_queue_.NextDeadline(), acquire_waits_.NextDeadline());
    if (next == absl::InfiniteFuture()) {
      next_deadline_.Wait(&mu_);
    } else {
      next_deadline_.WaitWithTimeout(&mu_, next - now);
    }
  }
}

}  // namespace tensorshm
