#include "server/lease_board.h"

#include <algorithm>
#include <atomic>
#include <limits>

#include "absl/strings/str_cat.h"

namespace tensorshm {
namespace {

const LeasePage& PageOf(const ShmSegment& shm) {
  return *static_cast<const LeasePage*>(shm.address());
}

}  // namespace

absl::StatusOr<int> LeaseBoard::Open(uint64_t session_id) {
  auto it = pages_.find(session_id);
  if (it == pages_.end()) {
    absl::StatusOr<ShmSegment> page =
        ShmSegment::Create(absl::StrCat("/tensorshm-leases-", session_id), kLeasePageBytes,
                           /*map=*/true, SegmentBacking::kMemfd);
    if (!page.ok()) return page.status();
    it = pages_.emplace(session_id, Page{*std::move(page)}).first;
  }
  return it->second.shm.OpenForClient(/*writable=*/true);
}

int64_t LeaseBoard::Drop(uint64_t session_id) {
  auto it = pages_.find(session_id);
  if (it == pages_.end()) return 0;
  // A client that has not noticed yet stops leasing through the page.
  LeasePage& page = *static_cast<LeasePage*>(it->second.shm.address());
  page.slots[kLeaseDaemonSlot].store(kLeasePageDropped, std::memory_order_seq_cst);
  FoldAcquires(it->second);
  int64_t held = 0;
  for (uint32_t i = kFirstLeaseSlot; i < kLeaseSlots; ++i) {
    if (page.slots[i].load(std::memory_order_seq_cst) != 0) ++held;
  }
  pages_.erase(it);
  return held;
}

void LeaseBoard::FoldAcquires(Page& page) {
  const uint64_t count =
      PageOf(page.shm).slots[kLeaseAcquireCountSlot].load(std::memory_order_acquire);
  if (count < page.acquires_seen) {
    page.acquires_seen = count;  // a client that went back: it counts on from there
    return;
  }
  const uint64_t added = std::min(count - page.acquires_seen, kMaxAcquiresPerRead);
  page.acquires_seen = count;
  fast_acquires_ = added > std::numeric_limits<uint64_t>::max() - fast_acquires_
                       ? std::numeric_limits<uint64_t>::max()
                       : fast_acquires_ + added;
}

uint64_t LeaseBoard::FastAcquires() {
  for (auto& [session, page] : pages_) FoldAcquires(page);
  return fast_acquires_;
}

std::vector<uint64_t> LeaseBoard::TakeRecent() {
  std::vector<uint64_t> recent;
  for (auto& [session, page] : pages_) {
    const LeasePage& shared = PageOf(page.shm);
    // Acquire: the ring entries of the acquires this count covers are stored before it.
    const uint64_t count = shared.slots[kLeaseAcquireCountSlot].load(std::memory_order_acquire);
    if (count <= page.recent_seen) {
      page.recent_seen = count;
      continue;
    }
    const uint64_t fresh = std::min<uint64_t>(count - page.recent_seen, kLeaseRecentSlots);
    for (uint64_t n = count - fresh; n < count; ++n) {
      // The client may be overwriting the entry meanwhile: then it holds a later acquire's id.
      const uint64_t id =
          shared.slots[kLeaseRecentSlot + n % kLeaseRecentSlots].load(std::memory_order_relaxed);
      if (id != 0) recent.push_back(id);
    }
    page.recent_seen = count;
  }
  return recent;
}

bool LeaseBoard::Holds(uint64_t tensor_id) const {
  for (const auto& [session, page] : pages_) {
    const LeasePage& shared = PageOf(page.shm);
    for (uint32_t i = kFirstLeaseSlot; i < kLeaseSlots; ++i) {
      if (shared.slots[i].load(std::memory_order_seq_cst) == tensor_id) return true;
    }
  }
  return false;
}

std::unordered_map<uint64_t, int64_t> LeaseBoard::Held() const {
  std::unordered_map<uint64_t, int64_t> held;
  for (const auto& [session, page] : pages_) {
    const LeasePage& shared = PageOf(page.shm);
    for (uint32_t i = kFirstLeaseSlot; i < kLeaseSlots; ++i) {
      const uint64_t id = shared.slots[i].load(std::memory_order_seq_cst);
      if (id != 0) ++held[id];
    }
  }
  return held;
}

int64_t LeaseBoard::SlotsHeld(uint64_t session_id) const {
  auto it = pages_.find(session_id);
  if (it == pages_.end()) return 0;
  const LeasePage& shared = PageOf(it->second.shm);
  int64_t held = 0;
  for (uint32_t i = kFirstLeaseSlot; i < kLeaseSlots; ++i) {
    if (shared.slots[i].load(std::memory_order_seq_cst) != 0) ++held;
  }
  return held;
}

}  // namespace tensorshm
