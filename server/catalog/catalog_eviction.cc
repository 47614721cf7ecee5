// Full pools: --evict lru (least recently used published tensors make room for a create, the
// creating uid's own first), what tells waiting creates that memory may have come free, and the
// count of records per uid (--uid-tensors) that eviction works within.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "common/tensor/layout.h"
#include "common/tensor/name.h"
#include "server/catalog/catalog.h"
#include "server/ops/log.h"
#include "server/ops/uid_limits.h"

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
    const DLDevice& device, uint32_t uid, bool for_record,
    const std::unordered_map<uint64_t, int64_t>& held) {
  std::vector<Tensor*> candidates;
  for (const auto& [name, id] : names_) {
    Tensor& tensor = tensors_.at(id);
    if (tensor.leases > 0 || tensor.recovered || held.count(tensor.id) > 0) continue;
    if (!for_record) {
      if (tensor.buffer.length == 0 || tensor.device.device_type != device.device_type ||
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

namespace {

// `candidates` (least recently used first) as an eviction for a create of `uid` may take them:
// `uid`'s own first, then those of the other uids that `over_share` names, each part in its
// order; the tensors of every other uid are left out.
template <typename OverShare>
std::vector<Tensor*> OwnFirst(const std::vector<Tensor*>& candidates, uint32_t uid,
                              OverShare over_share) {
  std::vector<Tensor*> ordered;
  ordered.reserve(candidates.size());
  for (Tensor* tensor : candidates) {
    if (tensor->owner_uid == uid) ordered.push_back(tensor);
  }
  for (Tensor* tensor : candidates) {
    if (tensor->owner_uid != uid && over_share(tensor->owner_uid)) ordered.push_back(tensor);
  }
  return ordered;
}

// "a create of N bytes on DEVICE by uid U", for eviction's log lines.
std::string CreateOf(uint64_t wanted, const DLDevice& device, uint32_t uid) {
  return absl::StrCat("a create of ", wanted, " bytes on ", DeviceName(device), " by uid ", uid);
}

}  // namespace

uint64_t Catalog::RecordShare(uint32_t uid) const {
  if (uid_tensors_ > 0) return uid_tensors_;
  const uint64_t sharing = records_of_.size() + (records_of_.count(uid) == 0 ? 1 : 0);
  return control_.record_count() / sharing;
}

void Catalog::Evict(Tensor& tensor, const std::string& why) {
  const std::string name = tensor.name;
  const uint64_t bytes = tensor.buffer.length;
  const absl::Duration age = absl::Now() - tensor.last_use;
  const bool acquired = tensor.acquired;
  ++evicted_tensors_;
  evicted_bytes_ += static_cast<int64_t>(bytes);
  TSM_LOG(kInfo) << "evicted \"" << LogEscape(name) << "\" (tensor " << tensor.id << " of uid "
                 << tensor.owner_uid << ", " << bytes << " bytes on " << DeviceName(tensor.device)
                 << ", " << (acquired ? "last acquired " : "never acquired, published ")
                 << absl::FormatDuration(absl::Trunc(age, absl::Milliseconds(1)))
                 << " ago) to make room for " << why << "; --evict lru)";
  // As Delete: out of the index first, then freed unless a lease page took it meanwhile (then
  // retired, and freed once the page lets go, as a deleted tensor is).
  TSM_CHECK(Delete(name).ok());
}

absl::Status Catalog::RoomForRecord(uint32_t uid, bool evict) {
  while (uid_tensors_ > 0 && RecordsOf(uid) >= uid_tensors_) {
    // Only the uid's own tensors: it is at its share, so nobody else's make room for it. Each
    // round unbinds one name, so this ends.
    std::vector<Tensor*> own;
    if (evict) {
      ReadLeasePages();  // what the pages hold now
      own = OwnFirst(EvictionCandidates({}, uid, /*for_record=*/true, lease_board_.Held()), uid,
                     [](uint32_t) { return false; });
    }
    if (own.empty()) return TensorRecordsExhausted(uid, RecordsOf(uid), uid_tensors_);
    Evict(*own.front(), absl::StrCat("a create by uid ", uid, " (it holds ", RecordsOf(uid),
                                     " tensor records, its limit, --uid-tensors"));
  }
  return absl::OkStatus();
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
    if (uid_tensors_ > 0 && RecordsOf(owner_uid) >= uid_tensors_) {
      // At its own limit of records: its own tensors make room, or nothing does.
      if (!RoomForRecord(owner_uid, /*evict=*/true).ok()) return tensor;
      continue;
    }
    const std::unordered_map<uint64_t, int64_t> held = lease_board_.Held();
    if (free_slots_.empty()) {
      // The record table is full: a record of any device will do, the creating uid's own first,
      // then those of uids past their share of records, if the creating uid is within its own.
      const uint64_t share = RecordShare(owner_uid);
      const bool within = RecordsOf(owner_uid) < share;
      std::vector<Tensor*> candidates =
          OwnFirst(EvictionCandidates(device, owner_uid, /*for_record=*/true, held), owner_uid,
                   [&](uint32_t other) { return within && RecordsOf(other) > share; });
      if (candidates.empty()) return tensor;
      Evict(*candidates.front(), absl::StrCat(CreateOf(wanted, device, owner_uid), " (all ",
                                              control_.record_count(), " tensor records in use"));
      continue;
    }
    std::vector<Tensor*> candidates =
        EvictionCandidates(device, owner_uid, /*for_record=*/false, held);
    if (device.device_type == kDLCUDA) {
      // A CUDA pool's segments are shared: the creating uid's own tensors first, then those of
      // uids past their share of the pool's bytes, if the create keeps it within its own.
      std::unordered_map<uint32_t, uint64_t> bytes_of;
      for (const auto& [id, held_tensor] : tensors_) {
        if (held_tensor.device.device_type == kDLCUDA &&
            held_tensor.device.device_id == device.device_id) {
          bytes_of[held_tensor.owner_uid] += held_tensor.buffer.length;
        }
      }
      const uint64_t sharing = bytes_of.size() + (bytes_of.count(owner_uid) == 0 ? 1 : 0);
      const uint64_t share = cuda_pools_.at(device.device_id)->capacity_bytes() / sharing;
      const bool within = bytes_of[owner_uid] + wanted <= share;
      candidates = OwnFirst(candidates, owner_uid,
                            [&](uint32_t other) { return within && bytes_of[other] > share; });
    }
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
    const std::string why = absl::StrCat(CreateOf(wanted, device, owner_uid), " (pool full");
    for (int i = 0; i < count; ++i) Evict(*candidates[i], why);
  }
}

}  // namespace tensorshm
