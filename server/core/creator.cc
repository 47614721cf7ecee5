#include "server/core/creator.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/tensor/layout.h"
#include "server/core/create_queue.h"
#include "server/memory/pool_refusal.h"

namespace tensorshm {
namespace {

// Stocked buffers (CreateOrder.stock): at most this many per request, of at most this size.
constexpr uint32_t kMaxStock = 64;
constexpr uint64_t kMaxStockedBytes = 4 << 20;

}  // namespace

Creator::Creator(Catalog& catalog, Leasing& leasing, const UidLimits& uid_limits, Metrics& metrics,
                 const CreateQueue& queue, GrowthQueue& growth, uint64_t session_quota_bytes)
    : catalog_(catalog),
      leasing_(leasing),
      uid_limits_(uid_limits),
      metrics_(metrics),
      queue_(queue),
      growth_(growth),
      session_quota_bytes_(session_quota_bytes) {}

absl::StatusOr<int> Creator::CudaOrdinalOf(const DLDevice& device, const std::string& uuid) const {
  if (device.device_type != kDLCUDA || uuid.size() != 16) {
    return absl::InvalidArgumentError(absl::StrCat("device_uuid: ", uuid.size(),
                                                   " bytes for device ", DeviceName(device),
                                                   "; only CUDA devices take one, of 16 bytes"));
  }
  DeviceUuid wanted;
  std::memcpy(wanted.data(), uuid.data(), wanted.size());
  std::string pools;
  for (const CudaPool* pool : catalog_.cuda_pools()) {
    if (pool->uuid() == wanted) return pool->ordinal();
    absl::StrAppend(&pools, pools.empty() ? "" : ", ", FormatUuid(pool->uuid()));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "device_uuid = ", FormatUuid(wanted), ": this tensorshmd has no pool for the device (",
      pools.empty() ? "no CUDA pools" : "CUDA pools on " + pools, "; see --cuda-pool)"));
}

absl::StatusOr<DLDevice> Creator::DeviceOf(const CreateOrder& order) const {
  DLDevice device = order.device;
  if (!order.device_uuid.empty()) {
    absl::StatusOr<int> ordinal = CudaOrdinalOf(device, order.device_uuid);
    if (!ordinal.ok()) return ordinal.status();
    device.device_id = *ordinal;
  }
  return device;
}

absl::StatusOr<Created> Creator::Create(Session& session, const CreateOrder& order,
                                        SegmentGrowth* growth, bool waited, bool* pool_full) {
  const TensorSpec& spec = order.spec;
  absl::StatusOr<DLDevice> resolved = DeviceOf(order);
  if (!resolved.ok()) return resolved.status();
  const DLDevice device = *resolved;
  // Quotas before any memory is taken: a refused create costs no allocation, no pool growth and
  // no eviction.
  if (absl::Status s = CheckQuotas(session, spec, device); !s.ok()) return s;
  // Then --uid-tensors: a uid at its share of records evicts its own (--evict lru) or is
  // refused as by a quota (it does not wait for memory, nor evict another uid's tensors).
  if (absl::Status s = catalog_.RoomForRecord(session.uid, evict_ == EvictPolicy::kLru); !s.ok()) {
    metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return s;
  }
  // Waiting creates come first: a new one for the same memory queues behind them.
  if (!waited) {
    if (absl::Status s = queue_.Blocking(KeyOf(session, device)); !s.ok()) {
      if (pool_full != nullptr) *pool_full = true;
      return s;
    }
  }
  // From its first host create on, the session's uid shares the host pool with the others.
  if (device.device_type == kDLCPU) session.uid_charge.MarkCreating();
  absl::StatusOr<const Tensor*> tensor =
      catalog_.Create(session.id, spec.dtype, spec.shape, spec.strides, device, spec.subbyte_padded,
                      session.uid, growth);
  if (absl::IsResourceExhausted(tensor.status()) && catalog_.retired_count() > 0 &&
      catalog_.Reclaim() > 0) {
    // Memory that lease pages let go of since the last housekeeping round is free now.
    tensor = catalog_.Create(session.id, spec.dtype, spec.shape, spec.strides, device,
                             spec.subbyte_padded, session.uid, growth);
  }
  if (absl::IsResourceExhausted(tensor.status()) && evict_ == EvictPolicy::kLru) {
    tensor = catalog_.CreateEvicting(session.id, spec.dtype, spec.shape, spec.strides, device,
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
    TSM_CHECK(catalog_.Abandon(session.id, tensor_id).ok());
    metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return absl::ResourceExhaustedError(
        absl::StrCat("session quota: ", length, " more bytes requested, ",
                     session.unpublished_bytes, " bytes of unpublished tensors held, quota ",
                     session_quota_bytes_, " bytes (--session-quota); publish or drop some first"));
  }
  if (absl::Status s = session.AddUnpublished((*tensor)->id, length); !s.ok()) {
    TSM_CHECK(catalog_.Abandon(session.id, (*tensor)->id).ok());
    if (absl::IsResourceExhausted(s)) metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return s;  // --uid-quota
  }
  Created created{.tensor_id = (*tensor)->id,
                  .desc = Leasing::DescriptionOf(**tensor),
                  .place = leasing_.PlaceOf(**tensor)};
  if (order.stock > 0 && device.device_type == kDLCPU && length > 0) {
    created.stocked = Stock(session, length, order.stock);
  }
  if (device.device_type == kDLCPU && length > 0) growth_.Ahead(session.uid);
  return created;
}

absl::Status Creator::CheckQuotas(Session& session, const TensorSpec& spec,
                                  const DLDevice& device) {
  absl::StatusOr<TensorLayout> layout =
      ComputeLayout(spec.dtype, spec.shape, spec.strides, spec.subbyte_padded);
  if (!layout.ok() || layout->nbytes <= 0) return absl::OkStatus();
  // The buffer's length as the pool rounds it (HostPool: whole pages; CudaPool: its alignment).
  const uint64_t unit = device.device_type == kDLCUDA ? kCudaAlignment : HostPool::PageSize();
  const uint64_t nbytes = static_cast<uint64_t>(layout->nbytes);
  if (nbytes > std::numeric_limits<uint64_t>::max() - unit) return absl::OkStatus();
  const uint64_t length = (nbytes + unit - 1) / unit * unit;
  // Larger than the whole pool: refused at once, never queued behind other waiting creates (no
  // memory that could come free would ever be enough).
  const CudaPool* cuda =
      device.device_type == kDLCUDA ? catalog_.cuda_pool(device.device_id) : nullptr;
  const uint64_t capacity = device.device_type == kDLCUDA
                                ? (cuda == nullptr ? 0 : cuda->capacity_bytes())
                                : catalog_.host_pool().capacity_bytes();
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

std::vector<Stocked> Creator::Stock(Session& session, uint64_t length, uint32_t count) {
  std::vector<Stocked> stocked;
  // Stock is memory nobody uses yet: it never takes the last eighth of the pool, and a session
  // or uid with a quota gets none (its quota is for what it creates).
  const HostPool& pool = catalog_.host_pool();
  count = std::min(count, kMaxStock);
  // Nor while creates wait for memory: what is freed is theirs.
  if (!queue_.empty() || session_quota_bytes_ > 0 || uid_limits_.config().unpublished_bytes > 0 ||
      length == 0 || length > kMaxStockedBytes ||
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
        catalog_.Create(session.id, DLDataType{kDLUInt, 8, 1}, absl::MakeConstSpan(&elements, 1),
                        {}, DLDevice{kDLCPU, 0}, false, session.uid, &not_for_stock);
    if (!tensor.ok()) break;
    if (!session.AddUnpublished((*tensor)->id, (*tensor)->buffer.length).ok()) {
      TSM_CHECK(catalog_.Abandon(session.id, (*tensor)->id).ok());
      break;
    }
    catalog_.MarkStocked((*tensor)->id);
    stocked.push_back(Stocked{.tensor_id = (*tensor)->id, .place = leasing_.PlaceOf(**tensor)});
  }
  return stocked;
}

}  // namespace tensorshm
