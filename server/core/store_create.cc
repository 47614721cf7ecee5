// Create: a create that does not wait for memory (one that may wait goes to CreateWaiting,
// store_create_waiters.cc), CreateFor (every transport's create) and its stock.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/tensor/layout.h"
#include "server/core/store.h"
#include "server/memory/pool_refusal.h"

namespace tensorshm {
namespace {

// Stocked buffers (CreateRequest.stock): at most this many per request, of at most this size.
constexpr uint32_t kMaxStock = 64;
constexpr uint64_t kMaxStockedBytes = 4 << 20;

}  // namespace

absl::StatusOr<int> Store::CudaOrdinalOf(const DLDevice& device, const std::string& uuid) const {
  if (device.device_type != kDLCUDA || uuid.size() != 16) {
    return absl::InvalidArgumentError(absl::StrCat("device_uuid: ", uuid.size(),
                                                   " bytes for device ", DeviceName(device),
                                                   "; only CUDA devices take one, of 16 bytes"));
  }
  DeviceUuid wanted;
  std::memcpy(wanted.data(), uuid.data(), wanted.size());
  std::string pools;
  for (const CudaPool* pool : catalog_->cuda_pools()) {
    if (pool->uuid() == wanted) return pool->ordinal();
    absl::StrAppend(&pools, pools.empty() ? "" : ", ", FormatUuid(pool->uuid()));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "device_uuid = ", FormatUuid(wanted), ": this tensorshmd has no pool for the device (",
      pools.empty() ? "no CUDA pools" : "CUDA pools on " + pools, "; see --cuda-pool)"));
}

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
  absl::StatusOr<Created> created = CreateFor(session, call->order, &growth);
  if (!growth.needed() && !growth.busy()) {
    if (!created.ok()) return created.status();
    call->created = *std::move(created);
    return KeepCreated(session.token, absl::OkStatus(), call->order.request_id, call->created);
  }
  // A pool must grow first: not on this thread, one of the transport's few.
  if (shutting_down_) return absl::UnavailableError("tensorshmd is stopping");
  pending_creates_.push_back(PendingCreate{call, session.token});
  creates_pending_.Signal();
  *answered_later = true;
  return absl::OkStatus();
}

absl::StatusOr<Created> Store::CreateFor(tensorshm::Session& session, const CreateOrder& order,
                                         SegmentGrowth* growth, bool waited, bool* pool_full) {
  const TensorSpec& spec = order.spec;
  DLDevice device = order.device;
  if (!order.device_uuid.empty()) {
    absl::StatusOr<int> ordinal = CudaOrdinalOf(device, order.device_uuid);
    if (!ordinal.ok()) return ordinal.status();
    device.device_id = *ordinal;
  }
  // Quotas before any memory is taken: a refused create costs no allocation, no pool growth and
  // no eviction.
  if (absl::Status s = CheckCreateQuotas(session, spec.dtype, spec.shape, spec.strides, device,
                                         spec.subbyte_padded);
      !s.ok()) {
    return s;
  }
  // Then --uid-tensors: a uid at its share of records evicts its own (--evict lru) or is
  // refused as by a quota (it does not wait for memory, nor evict another uid's tensors).
  if (absl::Status s = catalog_->RoomForRecord(session.uid, evict_ == EvictPolicy::kLru); !s.ok()) {
    metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return s;
  }
  // Waiting creates come first: a new one for the same memory queues behind them.
  const PoolKey key{device.device_type, device.device_id,
                    device.device_type == kDLCPU ? session.uid : 0};
  if (!waited) {
    if (absl::Status s = CheckCreateQueue(key); !s.ok()) {
      if (pool_full != nullptr) *pool_full = true;
      return s;
    }
  }
  // From its first host create on, the session's uid shares the host pool with the others.
  if (device.device_type == kDLCPU) session.uid_charge.MarkCreating();
  absl::StatusOr<const Tensor*> tensor =
      catalog_->Create(session.id, spec.dtype, spec.shape, spec.strides, device,
                       spec.subbyte_padded, session.uid, growth);
  if (absl::IsResourceExhausted(tensor.status()) && catalog_->retired_count() > 0 &&
      catalog_->Reclaim() > 0) {
    // Memory that lease pages let go of since the last housekeeping round is free now.
    tensor = catalog_->Create(session.id, spec.dtype, spec.shape, spec.strides, device,
                              spec.subbyte_padded, session.uid, growth);
  }
  if (absl::IsResourceExhausted(tensor.status()) && evict_ == EvictPolicy::kLru) {
    tensor = catalog_->CreateEvicting(session.id, spec.dtype, spec.shape, spec.strides, device,
                                      spec.subbyte_padded, session.uid, growth);
  }
  if (absl::IsResourceExhausted(tensor.status())) {
    // A tensor larger than the whole pool never fits: said at once, not after a wait.
    if (pool_full != nullptr && !NeverFits(tensor.status())) *pool_full = true;
    // Once per create: the tries of a create waiting for memory are not counted again.
    if (!waited) metrics_.CountAllocationFailure(AllocationFailure::kPool);
  }
  if (!tensor.ok()) return tensor.status();
  const uint64_t length = (*tensor)->buffer.length;
  if (session_quota_bytes_ > 0 && session.unpublished_bytes + length > session_quota_bytes_) {
    const uint64_t tensor_id = (*tensor)->id;
    TSM_CHECK(catalog_->Abandon(session.id, tensor_id).ok());
    metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return absl::ResourceExhaustedError(
        absl::StrCat("session quota: ", length, " more bytes requested, ",
                     session.unpublished_bytes, " bytes of unpublished tensors held, quota ",
                     session_quota_bytes_, " bytes (--session-quota); publish or drop some first"));
  }
  if (absl::Status s = session.AddUnpublished((*tensor)->id, length); !s.ok()) {
    TSM_CHECK(catalog_->Abandon(session.id, (*tensor)->id).ok());
    if (absl::IsResourceExhausted(s)) metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return s;  // --uid-quota
  }
  Created created{
      .tensor_id = (*tensor)->id, .desc = DescriptionOf(**tensor), .place = PlaceOf(**tensor)};
  if (order.stock > 0 && device.device_type == kDLCPU && length > 0) {
    created.stocked = Stock(session, length, order.stock);
  }
  if (device.device_type == kDLCPU && length > 0) GrowAhead(session.uid);
  return created;
}

std::vector<Stocked> Store::Stock(tensorshm::Session& session, uint64_t length, uint32_t count) {
  std::vector<Stocked> stocked;
  // Stock is memory nobody uses yet: it never takes the last eighth of the pool, and a session
  // or uid with a quota gets none (its quota is for what it creates).
  const HostPool& pool = catalog_->host_pool();
  count = std::min(count, kMaxStock);
  // Nor while creates wait for memory: what is freed is theirs.
  if (!creates_waiting_.empty() || session_quota_bytes_ > 0 ||
      uid_limits_.config().unpublished_bytes > 0 || length == 0 || length > kMaxStockedBytes ||
      pool.used_bytes() + (count + 0ull) * length > pool.capacity_bytes() / 8 * 7) {
    return stocked;
  }
  // Nor past an eighth of the uid's fair share: stock keeps a segment from being given back to
  // another uid, and a client takes its stock without a call, so it cannot be taken back.
  const uint64_t stock_bound = pool.FairShare(session.uid) / 8;
  if ((count + 0ull) * length > stock_bound) {
    count = static_cast<uint32_t>(stock_bound / length);
    if (count == 0) return stocked;
  }
  const int64_t elements = static_cast<int64_t>(length);
  for (uint32_t i = 0; i < count; ++i) {
    SegmentGrowth not_for_stock;  // asked for, never begun: stock takes no new segment
    absl::StatusOr<const Tensor*> tensor =
        catalog_->Create(session.id, DLDataType{kDLUInt, 8, 1}, absl::MakeConstSpan(&elements, 1),
                         {}, DLDevice{kDLCPU, 0}, false, session.uid, &not_for_stock);
    if (!tensor.ok()) break;
    if (!session.AddUnpublished((*tensor)->id, (*tensor)->buffer.length).ok()) {
      TSM_CHECK(catalog_->Abandon(session.id, (*tensor)->id).ok());
      break;
    }
    catalog_->MarkStocked((*tensor)->id);
    stocked.push_back(Stocked{.tensor_id = (*tensor)->id, .place = PlaceOf(**tensor)});
  }
  return stocked;
}

}  // namespace tensorshm
