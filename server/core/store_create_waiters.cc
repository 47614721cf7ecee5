// Creates that wait for memory (CreateOrder.wait_ms): when the pool cannot hold the buffer,
// the create (a CreateWait) waits on a first-come-first-served queue, tried again whenever
// memory may have come free (UnlockAndFinish sees the catalog's release epoch move), and ended by
// success, its deadline (ExpireWaiters), its cancellation, its session's end or BeginShutdown.
// No thread waits with it.
#include <algorithm>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "common/tensor/layout.h"
#include "server/core/store.h"
#include "server/memory/pool_refusal.h"
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

namespace {

// Ids of the tensors a create's answer carries (its own and the stocked ones).
std::vector<uint64_t> CreatedIds(const Created& created) {
  std::vector<uint64_t> ids = {created.tensor_id};
  for (const Stocked& stocked : created.stocked) ids.push_back(stocked.tensor_id);
  return ids;
}

}  // namespace

absl::Status Store::CreateWaiting(const PeerCredentials& peer,
                                  const std::optional<std::string>& token, CreateWait* waiter,
                                  bool* answered_later) {
  Lock lock(this);
  absl::StatusOr<tensorshm::Session*> caller = CallerSession(token, peer);
  if (!caller.ok()) return caller.status();
  tensorshm::Session& session = **caller;
  waiter->token = session.token;
  if (session.TakeSettled(waiter->order.request_id)) {
    return absl::CancelledError("create: settled (cancelled) by the client before it arrived");
  }
  SegmentGrowth growth;
  bool pool_full = false;
  absl::StatusOr<Created> created =
      CreateFor(session, waiter->order, &growth, /*waited=*/false, &pool_full);
  if (growth.needed() || growth.busy()) {
    // A pool must grow first: GrowPools answers it (or queues it if still full).
    if (shutting_down_) return absl::UnavailableError("tensorshmd is stopping");
    pending_creates_.push_back(PendingCreate{waiter, waiter->token, waiter});
    creates_pending_.Signal();
    *answered_later = true;
    return absl::OkStatus();
  }
  if (created.ok()) {
    waiter->created = *std::move(created);
    waiter->created_ids = CreatedIds(waiter->created);
    session.RecordGrant(waiter->order.request_id, {0, waiter->created_ids});
    return absl::OkStatus();
  }
  if (!pool_full) return created.status();
  if (shutting_down_) return absl::UnavailableError("tensorshmd is stopping");
  if (waiter->Cancelled()) return absl::CancelledError("create cancelled by the client");
  if (absl::Now() >= waiter->deadline) return created.status();
  if (absl::Status s = AddCreateWaiter(waiter, session, created.status()); !s.ok()) return s;
  *answered_later = true;  // queued: whoever takes it off the queue finishes it
  return absl::OkStatus();
}

void Store::FinishCreate(CreateWait* waiter, absl::Status status) {
  metrics_.CountOp(MetricOp::kCreate, status.code());
  const bool granted = status.ok() && waiter->order.request_id != 0;
  AnswerLater(waiter, std::move(status), granted);
}

absl::Status Store::AddCreateWaiter(CreateWait* waiter, const tensorshm::Session& session,
                                    const absl::Status& refusal) {
  absl::StatusOr<UidLimits::WaitCharge> charge = uid_limits_.StartWait(session.uid);
  if (!charge.ok()) return charge.status();
  waiter->wait_charge = *std::move(charge);
  DLDevice device = waiter->order.device;
  if (!waiter->order.device_uuid.empty()) {
    absl::StatusOr<int> ordinal = CudaOrdinalOf(device, waiter->order.device_uuid);
    TSM_CHECK(ordinal.ok());  // CreateFor resolved it
    device.device_id = *ordinal;
  }
  waiter->key =
      PoolKey{device.device_type, device.device_id, device.device_type == kDLCPU ? session.uid : 0};
  waiter->session_id = session.id;
  waiter->token = session.token;
  waiter->refusal = refusal;
  // The timer sleeps until the earliest deadline: wake it if this one is earlier.
  if (creates_waiting_.Add(waiter, waiter->key, session.id, waiter->deadline)) {
    next_deadline_.Signal();
  }
  TSM_LOG(kDebug) << "session " << session.id << ": create waits for memory (" << refusal.message()
                  << ")";
  return absl::OkStatus();
}

void Store::RemoveCreateWaiter(CreateWait* waiter) {
  creates_waiting_.Remove(waiter);
  waiter->wait_charge.reset();
  // The creates behind it no longer wait for it.
  retry_creates_ = true;
}

absl::Status Store::CheckCreateQuotas(tensorshm::Session& session, const DLDataType& dtype,
                                      absl::Span<const int64_t> shape,
                                      absl::Span<const int64_t> strides, const DLDevice& device,
                                      bool subbyte_padded) {
  absl::StatusOr<TensorLayout> layout = ComputeLayout(dtype, shape, strides, subbyte_padded);
  if (!layout.ok() || layout->nbytes <= 0) return absl::OkStatus();
  // The buffer's length as the pool rounds it (HostPool: whole pages; CudaPool: its alignment).
  const uint64_t unit = device.device_type == kDLCUDA ? kCudaAlignment : HostPool::PageSize();
  const uint64_t nbytes = static_cast<uint64_t>(layout->nbytes);
  if (nbytes > std::numeric_limits<uint64_t>::max() - unit) return absl::OkStatus();
  const uint64_t length = (nbytes + unit - 1) / unit * unit;
  // Larger than the whole pool: refused at once, never queued behind other waiting creates (no
  // memory that could come free would ever be enough).
  const CudaPool* cuda =
      device.device_type == kDLCUDA ? catalog_->cuda_pool(device.device_id) : nullptr;
  const uint64_t capacity = device.device_type == kDLCUDA
                                ? (cuda == nullptr ? 0 : cuda->capacity_bytes())
                                : catalog_->host_pool().capacity_bytes();
  if ((device.device_type != kDLCUDA || cuda != nullptr) && length > capacity) {
    metrics_.CountAllocationFailure(AllocationFailure::kPool);
    return NeverFitsError(absl::StrCat(
        device.device_type == kDLCUDA ? absl::StrCat("cuda:", device.device_id) : "host",
        " pool: cannot allocate ", nbytes, " bytes: larger than the whole pool (", capacity,
        device.device_type == kDLCUDA ? " bytes, --cuda-pool)" : " bytes, --host-pool)"));
  }
  if (session_quota_bytes_ > 0 && (length > session_quota_bytes_ ||
                                   session.unpublished_bytes > session_quota_bytes_ - length)) {
    metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return absl::ResourceExhaustedError(
        absl::StrCat("session quota: ", length, " more bytes requested, ",
                     session.unpublished_bytes, " bytes of unpublished tensors held, quota ",
                     session_quota_bytes_, " bytes (--session-quota); publish or drop some first"));
  }
  // --uid-quota, asked of the uid's counts as the create would charge them, and given back at
  // once: the create charges them for real, with its tensor's id, once it has its buffer. All
  // creates run under mu_, so nothing charges this uid in between.
  if (absl::Status s = session.uid_charge.AddUnpublished(length); !s.ok()) {
    if (absl::IsResourceExhausted(s)) metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return s;
  }
  session.uid_charge.DropUnpublished(length);
  return absl::OkStatus();
}

absl::Status Store::CheckCreateQueue(const PoolKey& key) const {
  const int64_t ahead = static_cast<int64_t>(creates_waiting_.CountWithKey(key));
  if (ahead == 0) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      PoolUsage(key), ": ", ahead, " earlier create", ahead == 1 ? " waits" : "s wait",
      " for memory", key.device_type == kDLCPU ? absl::StrCat(" of uid ", key.uid) : "",
      ", and creates are served in order (a create with a timeout queues behind them)"));
}

std::string Store::PoolUsage(const PoolKey& key) const {
  if (key.device_type == kDLCUDA) {
    const CudaPool* pool = catalog_->cuda_pool(key.device_id);
    if (pool == nullptr) return absl::StrCat("cuda:", key.device_id, " pool: none");
    return absl::StrCat("cuda:", key.device_id, " pool: ", pool->used_bytes(), " of ",
                        pool->capacity_bytes(), " bytes used");
  }
  const HostPool& pool = catalog_->host_pool();
  return absl::StrCat("host pool: ", pool.used_bytes(), " of ", pool.capacity_bytes(),
                      " bytes used");
}

void Store::RetryWaitingCreates() {
  retry_creates_ = false;
  std::set<PoolKey> blocked;  // keys whose earliest waiting create still does not fit
  for (CreateWait* waiter : creates_waiting_.All()) {
    if (blocked.count(waiter->key) > 0) continue;
    // A waiting create's session is alive: CloseSession takes its creates off first.
    tensorshm::Session* session = sessions_.Find(waiter->token);
    TSM_CHECK(session != nullptr);
    SegmentGrowth growth;
    bool pool_full = false;
    absl::StatusOr<Created> created =
        CreateFor(*session, waiter->order, &growth, /*waited=*/true, &pool_full);
    if (growth.needed() || growth.busy()) {
      RemoveCreateWaiter(waiter);
      pending_creates_.push_back(PendingCreate{waiter, waiter->token, waiter});
      creates_pending_.Signal();
      continue;
    }
    if (pool_full) {
      waiter->refusal = created.status();
      blocked.insert(waiter->key);
      continue;
    }
    RemoveCreateWaiter(waiter);
    const absl::Status status = created.status();
    if (created.ok()) {
      waiter->created = *std::move(created);
      waiter->created_ids = CreatedIds(waiter->created);
      session->RecordGrant(waiter->order.request_id, {0, waiter->created_ids});
      TSM_LOG(kDebug) << "session " << waiter->session_id << ": waiting create served after "
                      << absl::FormatDuration(absl::Now() - waiter->started);
    }
    FinishCreate(waiter, status);
  }
  // Retried now: what a retry itself freed (an eviction) needs no other round.
  retry_creates_ = false;
  retried_epoch_ = catalog_->release_epoch();
}

bool Store::ExpireCreates(absl::Time now) {
  bool expired = false;
  while (CreateWait* waiter = creates_waiting_.Expired(now)) {
    RemoveCreateWaiter(waiter);
    FinishCreate(waiter, waiter->Expired(PoolUsage(waiter->key)));
    expired = true;
  }
  return expired;
}

void Store::FailSessionCreates(uint64_t session_id, const std::string& token) {
  const absl::Status status = NoSession(token);
  for (CreateWait* waiter : creates_waiting_.OfSession(session_id)) {
    RemoveCreateWaiter(waiter);
    FinishCreate(waiter, status);
  }
}

void Store::FailWaitingCreates(const absl::Status& status) {
  for (CreateWait* waiter : creates_waiting_.All()) {
    RemoveCreateWaiter(waiter);
    FinishCreate(waiter, status);
  }
}

void Store::CancelCreate(CreateWait* waiter) {
  Lock lock(this);
  // Finished already, or being finished.
  if (!creates_waiting_.Contains(waiter)) return;
  RemoveCreateWaiter(waiter);
  FinishCreate(waiter, absl::CancelledError("create cancelled by the client"));
}

void Store::CreateWaiterDone(CreateWait* waiter, bool cancelled) {
  Lock lock(this);
  TSM_CHECK(!creates_waiting_.Contains(waiter));
  if (!cancelled || waiter->created_ids.empty()) return;
  // The test hook plays an answer that crossed the cancel: only the client's settle gives back.
  if (waiter->order.request_id != 0 && cross_cancel_hold_ > absl::ZeroDuration()) return;
  // Created, but the client gave up on the call before the answer reached it: nobody knows the
  // buffers' ids, so nobody would publish or drop them before the session ends.
  tensorshm::Session* session = sessions_.Find(waiter->token);
  if (session == nullptr) return;  // ended: its unpublished tensors went with it
  for (uint64_t id : waiter->created_ids) {
    if (session->unpublished.count(id) == 0) continue;
    if (catalog_->Abandon(session->id, id).ok()) session->ForgetUnpublished(id);
  }
}

void Store::FinishGrownCreate(CreateWait* waiter, const absl::Status& grown, bool pool_full) {
  absl::Status status = grown;
  if (status.ok()) {
    status = KeepCreated(waiter->token, NoSession(waiter->token), waiter->order.request_id,
                         waiter->created);
    if (status.ok()) waiter->created_ids = CreatedIds(waiter->created);
  } else if (pool_full && !shutting_down_ && absl::Now() < waiter->deadline &&
             !waiter->Cancelled()) {
    // The segment it waited for went to others: it waits for memory as any create.
    tensorshm::Session* session = sessions_.Find(waiter->token);
    if (session != nullptr && session->TakeSettled(waiter->order.request_id)) {
      FinishCreate(waiter, absl::CancelledError("create settled (cancelled) by the client"));
      return;
    }
    if (session != nullptr) {
      absl::Status queued = AddCreateWaiter(waiter, *session, status);
      if (queued.ok()) return;
      FinishCreate(waiter, queued);
      return;
    }
  }
  FinishCreate(waiter, status);
}

bool Store::CancelSettledCreate(uint64_t session_id, uint64_t request_id) {
  for (CreateWait* waiter : creates_waiting_.OfSession(session_id)) {
    if (waiter->order.request_id != request_id) continue;
    RemoveCreateWaiter(waiter);
    FinishCreate(waiter, absl::CancelledError("create settled (cancelled) by the client"));
    return true;
  }
  return false;
}

absl::Status Store::KeepCreated(const std::string& token, const absl::Status& gone,
                                uint64_t request_id, const Created& created) {
  if (request_id == 0) return absl::OkStatus();
  tensorshm::Session* session = sessions_.Find(token);
  if (session == nullptr) return gone;  // its unpublished tensors went with it
  if (!session->TakeSettled(request_id)) {
    session->RecordGrant(request_id, {0, CreatedIds(created)});
    return absl::OkStatus();
  }
  // Settled while its segment was being made: nobody will take these buffers.
  GiveBack(*session, {0, CreatedIds(created)});
  return absl::CancelledError("create: settled (cancelled) by the client");
}

}  // namespace tensorshm
