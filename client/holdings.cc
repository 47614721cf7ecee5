#include "client/holdings.h"

#include <algorithm>

namespace tensorshm {

uint64_t Holdings::AddLease(uint64_t tensor_id, uint64_t lease_id) {
  const uint64_t key = next_key_++;
  leases_.emplace(key, Lease{tensor_id, lease_id});
  ++outstanding_;
  return key;
}

uint64_t Holdings::AddUnpublished(uint64_t tensor_id) {
  const uint64_t key = next_key_++;
  unpublished_.emplace(key, tensor_id);
  ++outstanding_;
  return key;
}

const Holdings::Lease* Holdings::FindLease(uint64_t key) const {
  auto it = leases_.find(key);
  return it == leases_.end() ? nullptr : &it->second;
}

std::optional<uint64_t> Holdings::UnpublishedId(uint64_t key) const {
  auto it = unpublished_.find(key);
  if (it == unpublished_.end()) return std::nullopt;
  return it->second;
}

void Holdings::Published(uint64_t key) {
  unpublished_.erase(key);
  --outstanding_;
}

void Holdings::QueueRelease(uint64_t key) {
  releases_.push_back(key);
  ++queued_.releases;
  --outstanding_;
}

void Holdings::QueueAbandon(uint64_t key) {
  abandons_.push_back(key);
  ++queued_.abandons;
  --outstanding_;
}

bool Holdings::TakeBatch(v1::ReleaseBatch* batch, int max_ids) {
  size_t taken = 0;
  for (; taken < releases_.size() && batch->lease_ids_size() < max_ids; ++taken) {
    auto it = leases_.find(releases_[taken]);
    if (it == leases_.end()) continue;
    if (it->second.lease_id != 0) batch->add_lease_ids(it->second.lease_id);
    leases_.erase(it);
  }
  releases_.erase(releases_.begin(), releases_.begin() + taken);
  taken_.releases += taken;
  taken = 0;
  for (; taken < abandons_.size() && batch->abandoned_tensor_ids_size() < max_ids; ++taken) {
    auto it = unpublished_.find(abandons_[taken]);
    if (it == unpublished_.end()) continue;
    batch->add_abandoned_tensor_ids(it->second);
    unpublished_.erase(it);
  }
  abandons_.erase(abandons_.begin(), abandons_.begin() + taken);
  taken_.abandons += taken;
  taken = std::min<size_t>(settles_.size(), static_cast<size_t>(max_ids));
  batch->mutable_settled_request_ids()->Add(settles_.begin(), settles_.begin() + taken);
  settles_.erase(settles_.begin(), settles_.begin() + taken);
  return batch->lease_ids_size() > 0 || batch->abandoned_tensor_ids_size() > 0 ||
         batch->settled_request_ids_size() > 0;
}

void Holdings::DropQueued() {
  for (uint64_t key : releases_) leases_.erase(key);
  for (uint64_t key : abandons_) unpublished_.erase(key);
  // Settled, as is the batch the broken stream lost: nothing is left to send for them.
  taken_.releases += releases_.size();
  taken_.abandons += abandons_.size();
  settled_ = taken_;
  releases_.clear();
  abandons_.clear();
  settles_.clear();  // the dead session's grants went with it
}

Holdings::Reattach Holdings::ForReattach(v1::SessionOpen* open) const {
  Reattach asked;
  for (const auto& [key, lease] : leases_) {
    // A lease the last daemon already refused stays refused.
    if (lease.lease_id == 0) continue;
    asked.lease_keys.push_back(key);
    open->add_held_tensor_ids(lease.tensor_id);
  }
  for (const auto& [key, tensor_id] : unpublished_) {
    asked.unpublished_keys.push_back(key);
    open->add_unpublished_tensor_ids(tensor_id);
  }
  return asked;
}

std::vector<uint64_t> Holdings::Reattached(const Reattach& asked, const v1::SessionOpened& answer) {
  std::vector<uint64_t> lost;
  for (size_t i = 0; i < asked.lease_keys.size(); ++i) {
    const uint64_t lease_id =
        static_cast<int>(i) < answer.lease_ids_size() ? answer.lease_ids(i) : 0;
    Lease& lease = leases_.at(asked.lease_keys[i]);
    lease.lease_id = lease_id;
    if (lease_id == 0) lost.push_back(lease.tensor_id);
  }
  for (size_t i = 0; i < asked.unpublished_keys.size(); ++i) {
    if (static_cast<int>(i) >= answer.readopted_size() || !answer.readopted(i)) {
      lost.push_back(unpublished_.at(asked.unpublished_keys[i]));
      unpublished_.erase(asked.unpublished_keys[i]);
    }
  }
  return lost;
}

}  // namespace tensorshm
