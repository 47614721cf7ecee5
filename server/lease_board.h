// Lease pages (common/fast_path_layout.h): one per session, written by its client, read here to
// learn which tensors clients still read before their memory is freed.
#ifndef TENSORSHM_SERVER_LEASE_BOARD_H_
#define TENSORSHM_SERVER_LEASE_BOARD_H_

#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "common/fast_path_layout.h"
#include "server/shm_segment.h"

namespace tensorshm {

// Thread-compatible: the catalog serialises calls.
class LeaseBoard {
 public:
  // A read-write descriptor of session `session_id`'s lease page for its client (the caller
  // closes it); the page is made (all slots free) on the first call. Errors as
  // ShmSegment::Create.
  absl::StatusOr<int> Open(uint64_t session_id);
  // Forgets the page of a session that ended, whatever its slots hold, after folding its fast
  // acquire count into FastAcquires(). Returns how many slots held a tensor (leases its client
  // never released); 0 if the session had no page.
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

  // Whether any page holds `tensor_id`. Its loads are sequentially consistent: called after
  // the tensor was unlinked from the index (a sequentially consistent store), it sees every slot
  // a reader validated.
  bool Holds(uint64_t tensor_id) const;
  // Every tensor id some page holds, with the number of slots holding it (loaded as Holds).
  std::unordered_map<uint64_t, int64_t> Held() const;
  // Slots of session `session_id`'s page holding a tensor (loaded as Holds); 0 without a page.
  int64_t SlotsHeld(uint64_t session_id) const;

  size_t page_count() const { return pages_.size(); }

  // Far more fast acquires than one page's client can make between two reads (the housekeeping
  // thread reads every page each round, kHeartbeatIntervalNs).
  static constexpr uint64_t kMaxAcquiresPerRead = uint64_t{1} << 32;

 private:
  struct Page {
    ShmSegment shm;
    uint64_t acquires_seen = 0;  // its count at the last FastAcquires
    uint64_t recent_seen = 0;    // its count at the last TakeRecent
  };
  // Adds what `page`'s count moved since the last read to fast_acquires_.
  void FoldAcquires(Page& page);

  std::map<uint64_t, Page> pages_;  // by session id
  uint64_t fast_acquires_ = 0;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_LEASE_BOARD_H_
