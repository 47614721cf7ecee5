// Full pools: --evict lru (least recently used published tensors make room for a create), and
// what tells waiting creates that memory may have come free.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/check.h"
#include "common/layout.h"
#include "common/name.h"
#include "common/wire.h"
#include "server/catalog.h"
#include "server/log.h"

namespace tensorshm {

void Catalog::Touch(Tensor& tensor) {
  tensor.use_seq = ++use_clock_;
  tensor.last_use = absl::Now();
  tensor.acquired = true;
}

void Catalog::TouchHeld() {
  const std::unordered_map<uint64_t, int64_t> held = lease_board_.Held();
  std::set<uint64_t> now;
  for (const auto& [id, slots] : held) {
    now.insert(id);
    auto it = tensors_.find(id);
    if (it != tensors_.end() && it->second.sealed) Touch(it->second);
  }
  for (uint64_t id : lease_board_.TakeRecent()) {
    auto it = tensors_.find(id);
    if (it != tensors_.end() && it->second.sealed) Touch(it->second);
  }
  for (uint64_t id : held_last_) {
    if (now.count(id) == 0) {
      ++release_epoch_;  // let go of by a page: evictable now, perhaps
      break;
    }
  }
  held_last_ = std::move(now);
}

std::vector<Tensor*> Catalog::EvictionCandidates(
    const DLDevice& device, uint32_t uid, bool any_device,
    const std::unordered_map<uint64_t, int64_t>& held) {
  std::vector<Tensor*> candidates;
  for (const auto& [name, id] : names_) {
    Tensor& tensor = tensors_.at(id);
    if (tensor.leases > 0 || tensor.recovered || tensor.buffer.length == 0 ||
        held.count(tensor.id) > 0) {
      continue;
    }
    if (!any_device) {
      if (tensor.device.device_type != device.device_type ||
          tensor.device.device_id != device.device_id) {
        continue;
      }
      // Another uid's segments never hold this uid's buffers: freeing them would not help.
      if (device.device_type == kDLCPU && pool_->SegmentOwner(tensor.buffer.segment_id) != uid) {
        continue;
      }
    }
    candidates.push_back(&tensor);
  }
  std::sort(candidates.begin(), candidates.end(), [](const Tensor* a, const Tensor* b) {
    return a->use_seq != b->use_seq ? a->use_seq < b->use_seq : a->publish_seq < b->publish_seq;
  });
  return candidates;
}

void Catalog::Evict(Tensor& tensor, uint64_t wanted, const DLDevice& device) {
  const std::string name = tensor.name;
  const uint64_t bytes = tensor.buffer.length;
  const absl::Duration age = absl::Now() - tensor.last_use;
  const bool acquired = tensor.acquired;
  ++evicted_tensors_;
  evicted_bytes_ += static_cast<int64_t>(bytes);
  TSM_LOG(kInfo) << "evicted \"" << LogEscape(name) << "\" (tensor " << tensor.id << ", " << bytes
                 << " bytes on " << DeviceName(tensor.device) << ", "
                 << (acquired ? "last acquired " : "never acquired, published ")
                 << absl::FormatDuration(absl::Trunc(age, absl::Milliseconds(1)))
                 << " ago) to make room for a create of " << wanted << " bytes on "
                 << DeviceName(device) << " (--evict lru)";
  // As Delete: out of the index first, then freed unless a lease page took it meanwhile (then
  // retired, and freed once the page lets go, as a deleted tensor is).
  TSM_CHECK(Delete(name).ok());
}

absl::StatusOr<const Tensor*> Catalog::CreateEvicting(uint64_t session, const DLDataType& dtype,
                                                      absl::Span<const int64_t> shape,
                                                      absl::Span<const int64_t> strides,
                                                      const DLDevice& device, bool subbyte_padded,
                                                      uint32_t owner_uid, SegmentGrowth* growth) {
  while (true) {
    absl::StatusOr<const Tensor*> tensor =
        Create(session, dtype, shape, strides, device, subbyte_padded, owner_uid, growth);
    if (!absl::IsResourceExhausted(tensor.status())) return tensor;
    absl::StatusOr<TensorLayout> layout = ComputeLayout(dtype, shape, strides, subbyte_padded);
    TSM_CHECK(layout.ok());  // Create checked it
    const uint64_t wanted = static_cast<uint64_t>(layout->nbytes);
    ReadLeasePages();  // what the pages hold now, not at the last housekeeping round
    const std::unordered_map<uint64_t, int64_t> held = lease_board_.Held();
    if (free_slots_.empty()) {
      // The record table is full: any tensor's record will do.
      std::vector<Tensor*> candidates = EvictionCandidates(device, owner_uid, true, held);
      if (candidates.empty()) return tensor;
      Evict(*candidates.front(), wanted, device);
      continue;
    }
    std::vector<Tensor*> candidates = EvictionCandidates(device, owner_uid, false, held);
    std::vector<Buffer> buffers;
    buffers.reserve(candidates.size());
    for (const Tensor* candidate : candidates) buffers.push_back(candidate->buffer);
    int count = -1;
    if (wanted > 0 && !buffers.empty()) {
      count = device.device_type == kDLCUDA
                  ? cuda_pools_.at(device.device_id)->FreesToFit(wanted, buffers)
                  : pool_->FreesToFit(wanted, owner_uid, buffers);
    }
    if (count <= 0) return tensor;
    // Each round unbinds at least one name, so this ends.
    for (int i = 0; i < count; ++i) Evict(*candidates[i], wanted, device);
  }
}

}  // namespace tensorshm
