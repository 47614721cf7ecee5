#include "server/core/acquire_waits.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"

namespace tensorshm {

absl::Status AcquireWait::Expired() const {
  return absl::DeadlineExceededError(absl::StrCat(
      "name = \"", name, "\": not published within ",
      wait_ms > 0 ? absl::StrCat("wait_ms = ", wait_ms) : std::string("the call's deadline")));
}

AcquireWaits::AcquireWaits(Catalog& catalog, SessionTable& sessions, Leasing& leasing,
                           UidLimits& uid_limits, Metrics& metrics, Answers& answers,
                           CondVar& deadline_moved, absl::Duration cross_cancel_hold)
    : catalog_(catalog),
      sessions_(sessions),
      leasing_(leasing),
      uid_limits_(uid_limits),
      metrics_(metrics),
      answers_(answers),
      deadline_moved_(deadline_moved),
      cross_cancel_hold_(cross_cancel_hold) {}

absl::Status AcquireWaits::Acquire(Session& session, AcquireWait* waiter, bool stopping,
                                   bool* answered_later) {
  if (session.TakeSettled(waiter->request_id)) {
    return absl::CancelledError("acquire settled (cancelled) by the client before it arrived");
  }
  if (const Tensor* tensor = catalog_.Find(waiter->name); tensor != nullptr) {
    // A tensor whose record another process overwrote is DATA_LOSS, not served.
    if (absl::Status s = catalog_.Verify(tensor->id); !s.ok()) return s;
    if (absl::Status s = session.uid_charge.AddLeases(); !s.ok()) return s;
    waiter->granted = leasing_.Grant(session, *tensor);
    waiter->token = session.token;
    session.RecordGrant(waiter->request_id, {waiter->granted.lease_id, {}});
    return absl::OkStatus();
  }
  if (waiter->wait_ms == 0) {
    return absl::NotFoundError(absl::StrCat("name = \"", waiter->name, "\": not published"));
  }
  if (stopping) return absl::UnavailableError("tensorshmd is stopping");
  if (waiter->Cancelled()) return absl::CancelledError("acquire cancelled by the client");
  if (absl::Now() >= waiter->deadline) return waiter->Expired();
  if (absl::Status s = Add(waiter, session); !s.ok()) return s;
  *answered_later = true;  // listed: whoever takes it off the lists answers it
  return absl::OkStatus();
}

absl::Status AcquireWaits::Add(AcquireWait* waiter, const Session& session) {
  absl::StatusOr<UidLimits::WaitCharge> charge = uid_limits_.StartWait(session.uid);
  if (!charge.ok()) return charge.status();
  waiter->wait_charge = *std::move(charge);
  waiter->session_id = session.id;
  waiter->token = session.token;
  // The timer sleeps until the earliest deadline: wake it if this one is earlier.
  if (waiting_.Add(waiter, waiter->name, session.id, waiter->deadline)) deadline_moved_.Signal();
  waiter->waiting_since = absl::Now();
  metrics_.WaitStarted();
  return absl::OkStatus();
}

void AcquireWaits::Remove(AcquireWait* waiter) {
  waiting_.Remove(waiter);
  waiter->wait_charge.reset();
  metrics_.WaitEnded();
}

void AcquireWaits::Finish(AcquireWait* waiter, absl::Status status) {
  TSM_CHECK(!waiting_.Contains(waiter));
  const absl::StatusCode code = status.code();
  metrics_.CountOp(MetricOp::kAcquire, code);
  metrics_.ObserveAcquireWait(absl::Now() - waiter->waiting_since, code);
  const bool granted = status.ok() && waiter->request_id != 0;
  answers_.Later(waiter, std::move(status), granted);
}

void AcquireWaits::Wake(const std::string& name) {
  const std::vector<AcquireWait*> woken = waiting_.WithKey(name);
  if (woken.empty()) return;
  const Tensor* tensor = catalog_.Find(name);
  TSM_CHECK(tensor != nullptr);
  for (AcquireWait* waiter : woken) {
    Remove(waiter);
    // A waiter's session is alive: a session's end takes its waiters off first.
    Session* session = sessions_.Find(waiter->token);
    TSM_CHECK(session != nullptr);
    absl::Status refused = catalog_.Verify(tensor->id);
    if (refused.ok()) refused = session->uid_charge.AddLeases();
    if (!refused.ok()) {
      Finish(waiter, refused);
      continue;
    }
    waiter->granted = leasing_.Grant(*session, *tensor);
    session->RecordGrant(waiter->request_id, {waiter->granted.lease_id, {}});
    Finish(waiter, absl::OkStatus());
  }
}

void AcquireWaits::FailSession(uint64_t session_id, const absl::Status& status) {
  for (AcquireWait* waiter : waiting_.OfSession(session_id)) {
    Remove(waiter);
    Finish(waiter, status);
  }
}

void AcquireWaits::FailAll(const absl::Status& status) {
  for (AcquireWait* waiter : waiting_.All()) {
    Remove(waiter);
    Finish(waiter, status);
  }
}

bool AcquireWaits::Settle(uint64_t session_id, uint64_t request_id) {
  for (AcquireWait* waiter : waiting_.OfSession(session_id)) {
    if (waiter->request_id != request_id) continue;
    Remove(waiter);
    Finish(waiter, absl::CancelledError("acquire settled (cancelled) by the client"));
    return true;
  }
  return false;
}

void AcquireWaits::Cancel(AcquireWait* waiter) {
  // Answered already, or being answered.
  if (!waiting_.Contains(waiter)) return;
  Remove(waiter);
  Finish(waiter, absl::CancelledError("acquire cancelled by the client"));
}

void AcquireWaits::Done(AcquireWait* waiter, bool cancelled) {
  TSM_CHECK(!waiting_.Contains(waiter));
  if (!cancelled || waiter->granted.lease_id == 0) return;
  // The test hook plays an answer that crossed the cancel: only the client's settle gives back.
  if (waiter->request_id != 0 && cross_cancel_hold_ > absl::ZeroDuration()) return;
  // Granted, but the client gave up on the call before the answer reached it: nobody knows the
  // lease's id, so nobody would release it before its session ends.
  Session* session = sessions_.Find(waiter->token);
  if (session == nullptr) return;  // ended: its leases went with it
  leasing_.DropLease(*session, waiter->granted.lease_id);
}

bool AcquireWaits::Expire(absl::Time now) {
  bool expired = false;
  while (AcquireWait* waiter = waiting_.Expired(now)) {
    Remove(waiter);
    Finish(waiter, waiter->Expired());
    expired = true;
  }
  return expired;
}

}  // namespace tensorshm
