#include "server/lease_board.h"

#include <atomic>

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
    it = pages_.emplace(session_id, *std::move(page)).first;
  }
  return it->second.OpenForClient(/*writable=*/true);
}

int64_t LeaseBoard::Drop(uint64_t session_id) {
  auto it = pages_.find(session_id);
  if (it == pages_.end()) return 0;
  // A client that has not noticed yet stops leasing through the page.
  LeasePage& page = *static_cast<LeasePage*>(it->second.address());
  page.slots[0].store(kLeasePageDropped, std::memory_order_seq_cst);
  int64_t held = 0;
  for (uint32_t i = 1; i < kLeaseSlots; ++i) {
    if (page.slots[i].load(std::memory_order_seq_cst) != 0) ++held;
  }
  pages_.erase(it);
  return held;
}

bool LeaseBoard::Holds(uint64_t tensor_id) const {
  for (const auto& [session, shm] : pages_) {
    const LeasePage& page = PageOf(shm);
    for (uint32_t i = 1; i < kLeaseSlots; ++i) {
      if (page.slots[i].load(std::memory_order_seq_cst) == tensor_id) return true;
    }
  }
  return false;
}

std::unordered_map<uint64_t, int64_t> LeaseBoard::Held() const {
  std::unordered_map<uint64_t, int64_t> held;
  for (const auto& [session, shm] : pages_) {
    const LeasePage& page = PageOf(shm);
    for (uint32_t i = 1; i < kLeaseSlots; ++i) {
      const uint64_t id = page.slots[i].load(std::memory_order_seq_cst);
      if (id != 0) ++held[id];
    }
  }
  return held;
}

int64_t LeaseBoard::SlotsHeld(uint64_t session_id) const {
  auto it = pages_.find(session_id);
  if (it == pages_.end()) return 0;
  const LeasePage& page = PageOf(it->second);
  int64_t held = 0;
  for (uint32_t i = 1; i < kLeaseSlots; ++i) {
    if (page.slots[i].load(std::memory_order_seq_cst) != 0) ++held;
  }
  return held;
}

}  // namespace tensorshm
