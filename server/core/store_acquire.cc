// Acquires, and those that wait for a publish (no thread waits with them), and the Store's end
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

absl::Status AcquireWait::Expired() const {
  return absl::DeadlineExceededError(absl::StrCat(
      "name = \"", name, "\": not published within ",
      wait_ms > 0 ? absl::StrCat("wait_ms = ", wait_ms) : std::string("the call's deadline")));
}

absl::Status Store::Acquire(const PeerCredentials& peer, const std::optional<std::string>& token,
                            AcquireWait* waiter, bool* answered_later) {
  if (absl::Status s = ValidateName(waiter->name); !s.ok()) return s;
  Lock lock(this);
  absl::StatusOr<tensorshm::Session*> caller = CallerSession(token, peer);
  if (!caller.ok()) return caller.status();
  tensorshm::Session& session = **caller;
  if (session.TakeSettled(waiter->request_id)) {
    return absl::CancelledError("acquire settled (cancelled) by the client before it arrived");
  }
  if (const Tensor* tensor = catalog_->Find(waiter->name); tensor != nullptr) {
    // A tensor whose record another process overwrote is DATA_LOSS, not served.
    if (absl::Status s = catalog_->Verify(tensor->id); !s.ok()) return s;
    if (absl::Status s = session.uid_charge.AddLeases(); !s.ok()) return s;
    waiter->granted = Grant(session, *tensor);
    waiter->token = session.token;
    session.RecordGrant(waiter->request_id, {waiter->granted.lease_id, {}});
    return absl::OkStatus();
  }
  if (waiter->wait_ms == 0) {
    return absl::NotFoundError(absl::StrCat("name = \"", waiter->name, "\": not published"));
  }
  if (shutting_down_) return absl::UnavailableError("tensorshmd is stopping");
  if (waiter->Cancelled()) return absl::CancelledError("acquire cancelled by the client");
  if (absl::Now() >= waiter->deadline) return waiter->Expired();
  if (absl::Status s = AddWaiter(waiter, session); !s.ok()) return s;
  *answered_later = true;  // listed: whoever takes it off the lists finishes it
  return absl::OkStatus();
}

absl::Status Store::AddWaiter(AcquireWait* waiter, const tensorshm::Session& session) {
  absl::StatusOr<UidLimits::WaitCharge> charge = uid_limits_.StartWait(session.uid);
  if (!charge.ok()) return charge.status();
  waiter->wait_charge = *std::move(charge);
  waiter->session_id = session.id;
  waiter->token = session.token;
  // The timer sleeps until the earliest deadline: wake it if this one is earlier.
  if (acquires_waiting_.Add(waiter, waiter->name, session.id, waiter->deadline)) {
    next_deadline_.Signal();
  }
  waiter->waiting_since = absl::Now();
  metrics_.WaitStarted();
  return absl::OkStatus();
}

void Store::RemoveWaiter(AcquireWait* waiter) {
  acquires_waiting_.Remove(waiter);
  waiter->wait_charge.reset();
  metrics_.WaitEnded();
}

void Store::FinishLater(AcquireWait* waiter, absl::Status status) {
  TSM_CHECK(!acquires_waiting_.Contains(waiter));
  const absl::StatusCode code = status.code();
  metrics_.CountOp(MetricOp::kAcquire, code);
  metrics_.ObserveAcquireWait(absl::Now() - waiter->waiting_since, code);
  const bool granted = status.ok() && waiter->request_id != 0;
  AnswerLater(waiter, std::move(status), granted);
}

void Store::AnswerLater(PendingCall* call, absl::Status status, bool granted) {
  finishing_.push_back({call, std::move(status), granted});
}

void Store::UnlockAndFinish() {
  // Memory freed (or a waiting create gone) under this lock: the waiting creates try again.
  if (!creates_waiting_.empty() &&
      (retry_creates_ || catalog_->release_epoch() != retried_epoch_)) {
    RetryWaitingCreates();
  }
  std::vector<Finishing> finishing;
  finishing.swap(finishing_);
  mu_.unlock();
  for (Finishing& f : finishing) f.call->Answer(std::move(f.status), f.granted);
}

void Store::WakeWaiters(const std::string& name) {
  const std::vector<AcquireWait*> woken = acquires_waiting_.WithKey(name);
  if (woken.empty()) return;
  const Tensor* tensor = catalog_->Find(name);
  TSM_CHECK(tensor != nullptr);
  for (AcquireWait* waiter : woken) {
    RemoveWaiter(waiter);
    // A waiter's session is alive: CloseSession takes its waiters off first.
    tensorshm::Session* session = sessions_.Find(waiter->token);
    TSM_CHECK(session != nullptr);
    absl::Status refused = catalog_->Verify(tensor->id);
    if (refused.ok()) refused = session->uid_charge.AddLeases();
    if (!refused.ok()) {
      FinishLater(waiter, refused);
      continue;
    }
    waiter->granted = Grant(*session, *tensor);
    session->RecordGrant(waiter->request_id, {waiter->granted.lease_id, {}});
    FinishLater(waiter, absl::OkStatus());
  }
}

void Store::FailSessionWaiters(uint64_t session_id, const std::string& token) {
  const std::vector<AcquireWait*> failed = acquires_waiting_.OfSession(session_id);
  if (failed.empty()) return;
  const absl::Status status = NoSession(token);
  for (AcquireWait* waiter : failed) {
    RemoveWaiter(waiter);
    FinishLater(waiter, status);
  }
}

void Store::SettleRequest(tensorshm::Session& session, uint64_t request_id) {
  if (request_id == 0) return;
  // Granted: given back (whatever of it the client cannot know it holds).
  if (auto it = session.granted_requests.find(request_id); it != session.granted_requests.end()) {
    GiveBack(session, it->second);
    session.granted_requests.erase(it);
    return;
  }
  // Waiting (the client gave up before the daemon heard of it): ends now, with nothing granted.
  for (AcquireWait* waiter : acquires_waiting_.OfSession(session.id)) {
    if (waiter->request_id != request_id) continue;
    RemoveWaiter(waiter);
    FinishLater(waiter, absl::CancelledError("acquire settled (cancelled) by the client"));
    return;
  }
  if (CancelSettledCreate(session.id, request_id)) return;
  // Not arrived yet, answered without a grant, or being made (GrowPools): KeepCreated and the
  // calls' arrival look here.
  session.NoteSettled(request_id);
}

void Store::CancelWaiter(AcquireWait* waiter) {
  Lock lock(this);
  // Finished already, or being finished.
  if (!acquires_waiting_.Contains(waiter)) return;
  RemoveWaiter(waiter);
  FinishLater(waiter, absl::CancelledError("acquire cancelled by the client"));
}

void Store::WaiterDone(AcquireWait* waiter, bool cancelled) {
  Lock lock(this);
  TSM_CHECK(!acquires_waiting_.Contains(waiter));
  if (!cancelled || waiter->granted.lease_id == 0) return;
  // The test hook plays an answer that crossed the cancel: only the client's settle gives back.
  if (waiter->request_id != 0 && cross_cancel_hold_ > absl::ZeroDuration()) return;
  // Granted, but the client gave up on the call before the answer reached it: nobody knows the
  // lease's id, so nobody would release it before its session ends.
  tensorshm::Session* session = sessions_.Find(waiter->token);
  if (session == nullptr) return;  // ended: its leases went with it
  auto lease = session->leases.find(waiter->granted.lease_id);
  if (lease == session->leases.end()) return;
  catalog_->DropLease(lease->second);
  session->leases.erase(lease);
  session->uid_charge.DropLeases();
}

void Store::BeginShutdown() {
  Lock lock(this);
  shutting_down_ = true;
  catalog_->mutable_index().StopServing();
  const absl::Status stopping = absl::UnavailableError("tensorshmd is stopping");
  for (AcquireWait* waiter : acquires_waiting_.All()) {
    RemoveWaiter(waiter);
    FinishLater(waiter, stopping);
  }
  FailWaitingCreates(stopping);
  stopping_.SignalAll();
  next_deadline_.SignalAll();
  creates_pending_.SignalAll();
}

void Store::ExpireWaiters() {
  while (true) {
    Lock lock(this);
    if (shutting_down_) return;
    const absl::Time now = absl::Now();
    bool expired = false;
    while (AcquireWait* waiter = acquires_waiting_.Expired(now)) {
      RemoveWaiter(waiter);
      FinishLater(waiter, waiter->Expired());
      expired = true;
    }
    if (ExpireCreates(now)) expired = true;
    if (expired) continue;  // finished as `lock` goes, then the queue is looked at again
    const absl::Time next =
        std::min(creates_waiting_.NextDeadline(), acquires_waiting_.NextDeadline());
    if (next == absl::InfiniteFuture()) {
      next_deadline_.Wait(&mu_);
    } else {
      next_deadline_.WaitWithTimeout(&mu_, next - now);
    }
  }
}

}  // namespace tensorshm
