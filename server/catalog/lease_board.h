// Lease pages (common/shm/fast_path_layout.h): one per session, written by its client, read here to
// learn which tensors clients still read before their memory is freed.
//
// A page is the client's to write, so what it holds is taken only for what a client could have
// done through the fast path. The board keeps, per page, the slot values it read last and which
// of them it counts as leases; a slot counts when the board sees it change to the id of a tensor
// the session could hold then (a sealed tensor bound to a name, or the session's own unpublished
// tensor: the catalog's word, Acquirable), while the page's uid has room under --uid-leases (its
// RPC leases and counted slots together, UidLimits). Everything else in a page (ids not handed
// out, other sessions' unpublished tensors, deleted or recovered-unbound tensors, ids past the
// uid's room) is ignored: it keeps nothing.
//
// When a tensor's name goes (Unbound), the board reads every page once, as the fast path's
// protocol needs (the index was unlinked before, see fast_path_layout.h), and pins the tensor to
// the slots that count for it: no slot written later can be a lease on it (no reader can validate
// an acquire of an unlinked entry). From then on only those slots are read for it (Holds), so
// freeing a retired tensor costs what pins it, not every page. Counts (Held, held_slots,
// SlotsHeld) follow the pages by Read, whose per-call work on changed slots is bounded.
#ifndef TENSORSHM_SERVER_CATALOG_LEASE_BOARD_H_
#define TENSORSHM_SERVER_CATALOG_LEASE_BOARD_H_

#include <cstdint>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "common/base/unique_fd.h"
#include "common/shm/fast_path_layout.h"
#include "server/memory/shm_segment.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {

// Thread-compatible: the catalog serialises calls.
class LeaseBoard {
 public:
  // Whether session `session_id` could hold `tensor_id` through its lease page now: a tensor it
  // could acquire through the fast path, or its own unpublished one (a publish-and-acquire leases
  // its tensor in the page before the publish).
  using Acquirable = absl::FunctionRef<bool(uint64_t session_id, uint64_t tensor_id)>;

  LeaseBoard() = default;
  LeaseBoard(const LeaseBoard&) = delete;
  LeaseBoard& operator=(const LeaseBoard&) = delete;
  ~LeaseBoard();  // gives the counted slots back to the UidLimits, if still set

  // Counts the slots it takes for leases in `limits` (against --uid-leases, with the uids' RPC
  // leases) from now on; nullptr: no limit. Those counted in the previous one are given back to
  // it. REQUIRES: no slot counts yet if `limits` is not nullptr; `limits` outlives the board or
  // is unset (nullptr) before it goes.
  void set_uid_limits(UidLimits* limits);

  // A read-write descriptor of session `session_id`'s lease page for its client (the caller
  // closes it); the page is made (all slots free) on the first call, its slots counted for `uid`.
  // Errors as ShmSegment::Create.
  absl::StatusOr<UniqueFd> Open(uint64_t session_id, uint32_t uid);
  // Forgets the page of a session that ended, whatever its slots hold, after folding its fast
  // acquire count into FastAcquires(). Returns how many of its slots counted as leases; 0 if the
  // session had no page.
  int64_t Drop(uint64_t session_id);

  // The acquires clients' fast paths served since the board was made, as their pages' counts
  // (kLeaseAcquireCountSlot) say, read now: never decreasing. A count is a number a client wrote,
  // nothing more: what it adds since the last read is at most kMaxAcquiresPerRead, and a count
  // lower than the last one read is taken as the page's new starting point, adding nothing.
  uint64_t FastAcquires();
  // Tensor ids the recent rings (kLeaseRecentSlot) of pages whose count moved since the last call
  // name: up to kLeaseRecentSlots per page, the latest acquires. Any id a client wrote may be
  // among them; ids repeat.
  std::vector<uint64_t> TakeRecent();

  // Reads every page's slots and takes in the ones that changed since they were last read (see
  // the file comment), at most kMaxChangesPerRead of them; the rest at the next calls, from
  // where this one stopped.
  void Read(Acquirable acquirable);
  // As Read, for session `session_id`'s page alone, all its changes.
  void ReadPage(uint64_t session_id, Acquirable acquirable);

  // `tensor_id`'s name went (the index entry was unlinked before: a sequentially consistent
  // store): reads every slot holding it, with sequentially consistent loads, so it sees every
  // slot a reader validated, and pins the tensor to the slots that count for it. A slot that
  // changed to it since it was last read counts (it was bound until now) if its uid has room.
  void Unbound(uint64_t tensor_id, Acquirable acquirable);
  // Whether a slot the tensor was pinned to (Unbound) still holds it, read now. False for a
  // tensor never pinned.
  bool Holds(uint64_t tensor_id, Acquirable acquirable);
  // Forgets the pins of a tensor that was freed.
  void Forget(uint64_t tensor_id) { pins_.erase(tensor_id); }

  // Every tensor id counted slots hold, with their number, as of the last reads.
  const std::unordered_map<uint64_t, int64_t>& Held() const { return held_; }
  // All counted slots, as of the last reads.
  int64_t held_slots() const { return held_slots_; }
  // Counted slots of session `session_id`'s page, as of the last reads; 0 without a page.
  int64_t SlotsHeld(uint64_t session_id) const;

  size_t page_count() const { return pages_.size(); }

  // Far more fast acquires than one page's client can make between two reads (the housekeeping
  // thread reads every page each round, kHeartbeatIntervalNs).
  static constexpr uint64_t kMaxAcquiresPerRead = uint64_t{1} << 32;
  // Changed slots one Read takes in: bounds its time (each is a look-up of the tensor) however
  // fast clients rewrite their pages. A client's acquires and releases change two slots each.
  static constexpr int64_t kMaxChangesPerRead = 4096;

 private:
  struct Page {
    Page(ShmSegment page, uint32_t owner)
        : shm(std::move(page)), uid(owner), seen(kLeaseSlots, 0), counted(kLeaseSlots, false) {}

    ShmSegment shm;
    uint32_t uid = 0;
    uint64_t acquires_seen = 0;  // its count at the last FastAcquires
    uint64_t recent_seen = 0;    // its count at the last TakeRecent
    std::vector<uint64_t> seen;  // kLeaseSlots: what each slot held when last read
    std::vector<bool> counted;   // kLeaseSlots: whether that counts as a lease
    int64_t counted_slots = 0;
    bool warned = false;  // logged that its uid had no room for a slot
  };
  // Adds what `page`'s count moved since the last read to fast_acquires_.
  void FoldAcquires(Page& page);
  // Takes in that `slot` of `page` (of session `session_id`) holds `value` now: the slot no
  // longer counts for what it held, and counts for `value` if it is non-zero, `acquirable` and
  // the uid has room.
  void Change(uint64_t session_id, Page& page, uint32_t slot, uint64_t value, bool acquirable);
  // Reads `page`'s slots from `*slot` on, taking in changes while `*budget` lasts (each costs
  // one); `*slot` is where it stopped (kLeaseSlots: done).
  void ReadSlots(uint64_t session_id, Page& page, uint32_t* slot, int64_t* budget,
                 Acquirable acquirable);

  std::map<uint64_t, Page> pages_;  // by session id
  uint64_t fast_acquires_ = 0;
  UidLimits* limits_ = nullptr;
  std::unordered_map<uint64_t, int64_t> held_;  // tensor id -> counted slots holding it
  int64_t held_slots_ = 0;
  // Unbound tensors -> the (session, slot)s that held them then and may still.
  std::unordered_map<uint64_t, std::vector<std::pair<uint64_t, uint32_t>>> pins_;
  // Where the last Read stopped: it goes on from there.
  uint64_t read_session_ = 0;
  uint32_t read_slot_ = kFirstLeaseSlot;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CATALOG_LEASE_BOARD_H_
