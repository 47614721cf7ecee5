#include "server/core/create_queue.h"

#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "server/ops/log.h"

namespace tensorshm {

absl::Status CreateWait::Expired(const std::string& usage) const {
  return absl::ResourceExhaustedError(
      absl::StrCat(refusal.message(), "; waited ",
                   absl::FormatDuration(absl::Trunc(absl::Now() - started, absl::Milliseconds(1))),
                   " for memory to be freed (",
                   order.wait_ms > 0 ? absl::StrCat("wait_ms = ", order.wait_ms)
                                     : std::string("until the call's deadline"),
                   "); ", usage, "; delete or release tensors, or raise the pool's size"));
}

CreateQueue::CreateQueue(Catalog& catalog, SessionTable& sessions, Creator& creator,
                         Leasing& leasing, UidLimits& uid_limits, Metrics& metrics,
                         Answers& answers, GrowthQueue& growth, CondVar& deadline_moved,
                         absl::Duration cross_cancel_hold)
    : catalog_(catalog),
      sessions_(sessions),
      creator_(creator),
      leasing_(leasing),
      uid_limits_(uid_limits),
      metrics_(metrics),
      answers_(answers),
      growth_(growth),
      deadline_moved_(deadline_moved),
      cross_cancel_hold_(cross_cancel_hold) {}

absl::Status CreateQueue::Wait(Session& session, CreateWait* waiter, bool stopping,
                               bool* answered_later) {
  waiter->token = session.token;
  if (session.TakeSettled(waiter->order.request_id)) {
    return absl::CancelledError("create: settled (cancelled) by the client before it arrived");
  }
  SegmentGrowth growth;
  bool pool_full = false;
  absl::StatusOr<Created> created =
      creator_.Create(session, waiter->order, &growth, /*waited=*/false, &pool_full);
  if (growth.needed() || growth.busy()) {
    // A pool must grow first: the grower answers it (or queues it here if still full).
    if (stopping) return absl::UnavailableError("tensorshmd is stopping");
    growth_.Push({waiter, waiter->token, waiter});
    *answered_later = true;
    return absl::OkStatus();
  }
  if (created.ok()) {
    Served(waiter, session, *std::move(created));
    return absl::OkStatus();
  }
  if (!pool_full) return created.status();
  if (stopping) return absl::UnavailableError("tensorshmd is stopping");
  if (waiter->Cancelled()) return absl::CancelledError("create cancelled by the client");
  if (absl::Now() >= waiter->deadline) return created.status();
  if (absl::Status s = Add(waiter, session, created.status()); !s.ok()) return s;
  *answered_later = true;  // queued: whoever takes it off the queue answers it
  return absl::OkStatus();
}

void CreateQueue::Served(CreateWait* waiter, Session& session, Created created) {
  waiter->created = std::move(created);
  waiter->created_ids = Leasing::IdsOf(waiter->created);
  session.RecordGrant(waiter->order.request_id, {0, waiter->created_ids});
}

void CreateQueue::Finish(CreateWait* waiter, absl::Status status) {
  metrics_.CountOp(MetricOp::kCreate, status.code());
  const bool granted = status.ok() && waiter->order.request_id != 0;
  answers_.Later(waiter, std::move(status), granted);
}

absl::Status CreateQueue::Add(CreateWait* waiter, const Session& session,
                              const absl::Status& refusal) {
  absl::StatusOr<UidLimits::WaitCharge> charge = uid_limits_.StartWait(session.uid);
  if (!charge.ok()) return charge.status();
  waiter->wait_charge = *std::move(charge);
  absl::StatusOr<DLDevice> device = creator_.DeviceOf(waiter->order);
  TSM_CHECK(device.ok());  // its create resolved it
  waiter->key = Creator::KeyOf(session, *device);
  waiter->session_id = session.id;
  waiter->token = session.token;
  waiter->refusal = refusal;
  // The timer sleeps until the earliest deadline: wake it if this one is earlier.
  if (waiting_.Add(waiter, waiter->key, session.id, waiter->deadline)) deadline_moved_.Signal();
  TSM_LOG(kDebug) << "session " << session.id << ": create waits for memory (" << refusal.message()
                  << ")";
  return absl::OkStatus();
}

void CreateQueue::Remove(CreateWait* waiter) {
  waiting_.Remove(waiter);
  waiter->wait_charge.reset();
  // The creates behind it no longer wait for it.
  retry_ = true;
}

absl::Status CreateQueue::Blocking(const PoolKey& key) const {
  const int64_t ahead = static_cast<int64_t>(waiting_.CountWithKey(key));
  if (ahead == 0) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      PoolUsage(key), ": ", ahead, " earlier create", ahead == 1 ? " waits" : "s wait",
      " for memory", key.device_type == kDLCPU ? absl::StrCat(" of uid ", key.uid) : "",
      ", and creates are served in order (a create with a timeout queues behind them)"));
}

std::string CreateQueue::PoolUsage(const PoolKey& key) const {
  if (key.device_type == kDLCUDA) {
    const CudaPool* pool = catalog_.cuda_pool(key.device_id);
    if (pool == nullptr) return absl::StrCat("cuda:", key.device_id, " pool: none");
    return absl::StrCat("cuda:", key.device_id, " pool: ", pool->used_bytes(), " of ",
                        pool->capacity_bytes(), " bytes used");
  }
  const HostPool& pool = catalog_.host_pool();
  return absl::StrCat("host pool: ", pool.used_bytes(), " of ", pool.capacity_bytes(),
                      " bytes used");
}

void CreateQueue::Retry() {
  retry_ = false;
  std::set<PoolKey> blocked;  // keys whose earliest waiting create still does not fit
  for (CreateWait* waiter : waiting_.All()) {
    if (blocked.count(waiter->key) > 0) continue;
    // A waiting create's session is alive: a session's end takes its creates off first.
    Session* session = sessions_.Find(waiter->token);
    TSM_CHECK(session != nullptr);
    SegmentGrowth growth;
    bool pool_full = false;
    absl::StatusOr<Created> created =
        creator_.Create(*session, waiter->order, &growth, /*waited=*/true, &pool_full);
    if (growth.needed() || growth.busy()) {
      Remove(waiter);
      growth_.Push({waiter, waiter->token, waiter});
      continue;
    }
    if (pool_full) {
      waiter->refusal = created.status();
      blocked.insert(waiter->key);
      continue;
    }
    Remove(waiter);
    const absl::Status status = created.status();
    if (created.ok()) {
      Served(waiter, *session, *std::move(created));
      TSM_LOG(kDebug) << "session " << waiter->session_id << ": waiting create served after "
                      << absl::FormatDuration(absl::Now() - waiter->started);
    }
    Finish(waiter, status);
  }
  // Retried now: what a retry itself freed (an eviction) needs no other round.
  retry_ = false;
  retried_epoch_ = catalog_.release_epoch();
}

bool CreateQueue::Expire(absl::Time now) {
  bool expired = false;
  while (CreateWait* waiter = waiting_.Expired(now)) {
    Remove(waiter);
    Finish(waiter, waiter->Expired(PoolUsage(waiter->key)));
    expired = true;
  }
  return expired;
}

void CreateQueue::FailSession(uint64_t session_id, const absl::Status& status) {
  for (CreateWait* waiter : waiting_.OfSession(session_id)) {
    Remove(waiter);
    Finish(waiter, status);
  }
}

void CreateQueue::FailAll(const absl::Status& status) {
  for (CreateWait* waiter : waiting_.All()) {
    Remove(waiter);
    Finish(waiter, status);
  }
}

void CreateQueue::Cancel(CreateWait* waiter) {
  // Answered already, or being answered.
  if (!waiting_.Contains(waiter)) return;
  Remove(waiter);
  Finish(waiter, absl::CancelledError("create cancelled by the client"));
}

void CreateQueue::Done(CreateWait* waiter, bool cancelled) {
  TSM_CHECK(!waiting_.Contains(waiter));
  if (!cancelled || waiter->created_ids.empty()) return;
  // The test hook plays an answer that crossed the cancel: only the client's settle gives back.
  if (waiter->order.request_id != 0 && cross_cancel_hold_ > absl::ZeroDuration()) return;
  // Created, but the client gave up on the call before the answer reached it: nobody knows the
  // buffers' ids, so nobody would publish or drop them before the session ends.
  Session* session = sessions_.Find(waiter->token);
  if (session == nullptr) return;  // ended: its unpublished tensors went with it
  leasing_.GiveBack(*session, {0, waiter->created_ids});
}

void CreateQueue::FinishGrown(CreateWait* waiter, const absl::Status& grown, bool pool_full,
                              bool stopping) {
  absl::Status status = grown;
  if (status.ok()) {
    status = leasing_.KeepCreated(waiter->token, NoSessionError(waiter->token),
                                  waiter->order.request_id, waiter->created);
    if (status.ok()) waiter->created_ids = Leasing::IdsOf(waiter->created);
  } else if (pool_full && !stopping && absl::Now() < waiter->deadline && !waiter->Cancelled()) {
    // The segment it waited for went to others: it waits for memory as any create.
    Session* session = sessions_.Find(waiter->token);
    if (session != nullptr && session->TakeSettled(waiter->order.request_id)) {
      Finish(waiter, absl::CancelledError("create settled (cancelled) by the client"));
      return;
    }
    if (session != nullptr) {
      absl::Status queued = Add(waiter, *session, status);
      if (queued.ok()) return;
      Finish(waiter, queued);
      return;
    }
  }
  Finish(waiter, status);
}

bool CreateQueue::Settle(uint64_t session_id, uint64_t request_id) {
  for (CreateWait* waiter : waiting_.OfSession(session_id)) {
    if (waiter->order.request_id != request_id) continue;
    Remove(waiter);
    Finish(waiter, absl::CancelledError("create settled (cancelled) by the client"));
    return true;
  }
  return false;
}

}  // namespace tensorshm
