#include "server/catalog/lease_board.h"

#include <algorithm>
#include <atomic>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "server/ops/log.h"

namespace tensorshm {
namespace {

constexpr uint32_t kSlotsPerBlock = 8;

const LeasePage& PageOf(const ShmSegment& shm) {
  return *static_cast<const LeasePage*>(shm.address());
}

}  // namespace

LeaseBoard::~LeaseBoard() { set_uid_limits(nullptr); }

void LeaseBoard::set_uid_limits(UidLimits* limits) {
  if (limits_ != nullptr) {
    for (const auto& [session, page] : pages_) {
      limits_->DropPageLeases(page.uid, static_cast<uint64_t>(page.counted_slots));
    }
  }
  TSM_CHECK(limits == nullptr || held_slots_ == 0);
  limits_ = limits;
}

absl::StatusOr<UniqueFd> LeaseBoard::Open(uint64_t session_id, uint32_t uid) {
  auto it = pages_.find(session_id);
  if (it == pages_.end()) {
    absl::StatusOr<ShmSegment> shm =
        ShmSegment::Create(absl::StrCat("/tensorshm-leases-", session_id), kLeasePageBytes,
                           /*map=*/true, SegmentBacking::kMemfd);
    if (!shm.ok()) return shm.status();
    it = pages_.emplace(session_id, Page(*std::move(shm), uid)).first;
  }
  return it->second.shm.OpenForClient(/*writable=*/true);
}

int64_t LeaseBoard::Drop(uint64_t session_id) {
  auto it = pages_.find(session_id);
  if (it == pages_.end()) return 0;
  Page& page = it->second;
  // A client that has not noticed yet stops leasing through the page.
  LeasePage& shared = *static_cast<LeasePage*>(page.shm.address());
  shared.slots[kLeaseDaemonSlot].store(kLeasePageDropped, std::memory_order_seq_cst);
  FoldAcquires(page);
  const int64_t counted = page.counted_slots;
  for (uint32_t i = kFirstLeaseSlot; i < kLeaseSlots; ++i) {
    if (page.counted[i]) Change(session_id, page, i, 0, false);
  }
  // Pins naming the page go when their tensors are next asked about (Holds).
  pages_.erase(it);
  return counted;
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

void LeaseBoard::Change(uint64_t session_id, Page& page, uint32_t slot, uint64_t value,
                        bool acquirable) {
  if (page.counted[slot]) {
    auto held = held_.find(page.seen[slot]);
    TSM_CHECK(held != held_.end() && held->second > 0);
    if (--held->second == 0) held_.erase(held);
    page.counted[slot] = false;
    --page.counted_slots;
    --held_slots_;
    if (limits_ != nullptr) limits_->DropPageLeases(page.uid, 1);
  }
  page.seen[slot] = value;
  if (value == 0 || !acquirable) return;
  if (limits_ != nullptr) {
    if (absl::Status room = limits_->AddPageLeases(page.uid, 1); !room.ok()) {
      if (!page.warned) {
        page.warned = true;
        TSM_LOG(kWarning) << "session " << session_id
                          << ": lease page slots past its uid's room are ignored and keep "
                             "nothing: "
                          << room.message();
      }
      return;
    }
  }
  page.counted[slot] = true;
  ++page.counted_slots;
  ++held_slots_;
  ++held_[value];
}

void LeaseBoard::ReadSlots(uint64_t session_id, Page& page, uint32_t* slot, int64_t* budget,
                           Acquirable acquirable) {
  static_assert(kFirstLeaseSlot % kSlotsPerBlock == 0 && kLeaseSlots % kSlotsPerBlock == 0);
  const LeasePage& shared = PageOf(page.shm);
  // Relaxed: counts only. What frees memory reads its slots again (Unbound, Holds).
  while (*slot < kLeaseSlots) {
    if (*slot % kSlotsPerBlock == 0) {
      // Most of a page is as it was: a block at a time, without a branch per slot.
      uint64_t changed = 0;
      for (uint32_t i = *slot; i < *slot + kSlotsPerBlock; ++i) {
        changed |= shared.slots[i].load(std::memory_order_relaxed) ^ page.seen[i];
      }
      if (changed == 0) {
        *slot += kSlotsPerBlock;
        continue;
      }
    }
    const uint64_t value = shared.slots[*slot].load(std::memory_order_relaxed);
    if (value != page.seen[*slot]) {
      if (*budget <= 0) return;
      --*budget;
      Change(session_id, page, *slot, value, value != 0 && acquirable(session_id, value));
    }
    ++*slot;
  }
}

void LeaseBoard::Read(Acquirable acquirable) {
  if (pages_.empty()) return;
  int64_t budget = kMaxChangesPerRead;
  auto start = pages_.lower_bound(read_session_);
  uint32_t slot = kFirstLeaseSlot;
  if (start == pages_.end()) {
    start = pages_.begin();
  } else if (start->first == read_session_) {
    slot = read_slot_;
  }
  // Once round the pages from where the last call stopped, and the first one again last (its
  // slots before where it began).
  auto it = start;
  for (size_t n = 0; n <= pages_.size(); ++n) {
    ReadSlots(it->first, it->second, &slot, &budget, acquirable);
    if (slot < kLeaseSlots) {  // out of budget: on from here next time
      read_session_ = it->first;
      read_slot_ = slot;
      return;
    }
    slot = kFirstLeaseSlot;
    if (++it == pages_.end()) it = pages_.begin();
  }
  read_session_ = start->first;
  read_slot_ = kFirstLeaseSlot;
}

void LeaseBoard::ReadPage(uint64_t session_id, Acquirable acquirable) {
  auto it = pages_.find(session_id);
  if (it == pages_.end()) return;
  uint32_t slot = kFirstLeaseSlot;
  int64_t budget = kLeaseSlots;
  ReadSlots(session_id, it->second, &slot, &budget, acquirable);
}

void LeaseBoard::Unbound(uint64_t tensor_id, Acquirable acquirable) {
  std::vector<std::pair<uint64_t, uint32_t>> pins;
  for (auto& [session, page] : pages_) {
    const LeasePage& shared = PageOf(page.shm);
    for (uint32_t i = kFirstLeaseSlot; i < kLeaseSlots; ++i) {
      const uint64_t value = shared.slots[i].load(std::memory_order_seq_cst);
      if (value != tensor_id && page.seen[i] != tensor_id) continue;
      if (value != page.seen[i]) {
        // Written since the last read: before the unlink, while the tensor was bound, if a
        // reader validated it.
        Change(session, page, i, value,
               value == tensor_id || (value != 0 && acquirable(session, value)));
      }
      if (value == tensor_id && page.counted[i]) pins.emplace_back(session, i);
    }
  }
  if (!pins.empty()) pins_[tensor_id] = std::move(pins);
}

bool LeaseBoard::Holds(uint64_t tensor_id, Acquirable acquirable) {
  auto it = pins_.find(tensor_id);
  if (it == pins_.end()) return false;
  std::vector<std::pair<uint64_t, uint32_t>>& pins = it->second;
  for (size_t n = 0; n < pins.size();) {
    const auto [session, slot] = pins[n];
    auto page = pages_.find(session);
    bool holds = false;
    if (page != pages_.end()) {
      Page& p = page->second;
      const uint64_t value = PageOf(p.shm).slots[slot].load(std::memory_order_seq_cst);
      if (value != p.seen[slot]) {
        // A pinned tensor is never taken in again: no acquire of it can be valid now.
        Change(session, p, slot, value,
               value != tensor_id && value != 0 && acquirable(session, value));
      }
      holds = p.seen[slot] == tensor_id && p.counted[slot];
    }
    if (holds) {
      ++n;
    } else {
      pins[n] = pins.back();
      pins.pop_back();
    }
  }
  if (pins.empty()) {
    pins_.erase(it);
    return false;
  }
  return true;
}

int64_t LeaseBoard::SlotsHeld(uint64_t session_id) const {
  auto it = pages_.find(session_id);
  return it == pages_.end() ? 0 : it->second.counted_slots;
}

}  // namespace tensorshm
