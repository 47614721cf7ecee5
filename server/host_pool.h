// The host pool: shm segments (named or memfd), grown one at a time up to the configured
// capacity, each with a best-fit allocator. Every segment holds the buffers of one uid: the
// daemon's own uid shares the first segments; each other admitted uid gets segments of its own,
// so that a writable descriptor of a segment never exposes another uid's tensors. Another uid's
// segments are always memfds sealed against resizing, whatever the pool's backing: a descriptor
// it can write through must not let it shrink or grow an object others map (or that a restarted
// daemon checks); the price is that its tensors do not survive the daemon.
#ifndef TENSORSHM_SERVER_HOST_POOL_H_
#define TENSORSHM_SERVER_HOST_POOL_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/allocator.h"
#include "server/control_segment.h"
#include "server/shm_segment.h"

namespace tensorshm {

// [segment_id, offset, length) of the pool. Page-aligned and page-rounded.
struct Buffer {
  uint64_t segment_id = 0;  // 1-based; 0 for "no buffer" (empty tensors)
  uint64_t offset = 0;
  uint64_t length = 0;
};

// What a pool's Allocate tells a caller that grows pools itself: making a segment reserves all
// its memory (posix_fallocate, cuMemAlloc), which is too slow to do under the caller's lock.
// One caller grows a pool at a time; others are told to wait for it.
struct GrowthRequest {
  bool needed = false;  // nothing fits: make segment `segment_id` of `size` bytes, then retry
  bool busy = false;    // nothing fits and another caller is making a segment: wait, then retry
  uint64_t segment_id = 0;
  uint64_t size = 0;
  uint32_t uid = 0;  // host pools: the uid whose buffers the segment holds
};

struct HostPoolOptions {
  std::string shm_prefix;
  uint64_t capacity_bytes = 0;
  uint64_t segment_bytes = 0;
  SegmentBacking backing = SegmentBacking::kNamed;
  uint32_t owner_uid = 0;  // the daemon's uid
  uint64_t instance = 0;   // this daemon start's id, recorded on the segments it creates
};

// Thread-compatible: the catalog serialises access.
class HostPool {
 public:
  // Creates the pool and its first segment (min(segment_bytes, capacity_bytes) bytes, for the
  // owner uid), recording segments in `control`, which must outlive the pool. Errors as
  // ShmSegment::Create, or INVALID_ARGUMENT for sizes that are zero or not page multiples.
  static absl::StatusOr<HostPool> Create(const HostPoolOptions& options, ControlSegment* control);

  // Re-opens the segments `control` records as live (a restarted daemon), each with a fully free
  // allocator: the catalog then reserves what its records hold. Errors name the segment (an
  // object the daemon did not create is refused: see ShmSegment::Open); on error every segment
  // object is left in place.
  static absl::StatusOr<HostPool> Recover(const HostPoolOptions& options, ControlSegment* control);

  // Marks [offset, offset + length) of segment `segment_id` used, as a recovered record says.
  // False (and nothing changed) if the range is not in a segment or not free.
  bool Reserve(const Buffer& buffer);

  // Leaves every segment in place when the pool is destroyed (--keep-segments).
  void KeepSegments();

  // Writes back every SegmentRecord of the control segment that no longer says what the pool
  // knows of its segment (another process wrote it), and marks unused every record past the
  // pool's segments: clients keep mapping the segments, and a later recovery finds them. Returns
  // how many records it rewrote.
  int RepairSegmentRecords() const;

  // Returns a buffer of at least `nbytes` (rounded up to whole pages) for `uid`: the most
  // recently freed buffer of that length if it is still free (hot memory), else taken best-fit
  // from that uid's segments or, failing that, from a new segment of its own while the capacity
  // allows. Not cleared: it holds zeros or bytes of earlier buffers of the same uid.
  // RESOURCE_EXHAUSTED naming the requested, free and largest-free sizes when nothing fits.
  // REQUIRES: nbytes > 0. With `growth`, a new segment is not made here: UNAVAILABLE, with
  // `*growth` saying which segment to make (BeginGrowth, MakeSegment, EndGrowth) or that another
  // caller is making one. REQUIRES (without `growth`): no growth under way.
  absl::StatusOr<Buffer> Allocate(uint64_t nbytes, uint32_t uid, GrowthRequest* growth = nullptr);

  // Growing the pool outside the caller's lock: BeginGrowth marks the pool as growing (until
  // EndGrowth); MakeSegment creates the object `request` names and may run concurrently with
  // every other call (it reads only what the pool fixed at its creation); EndGrowth adds what
  // MakeSegment made, or returns its error. REQUIRES: `request` is the one Allocate gave, with
  // `needed`; BeginGrowth before, and EndGrowth after, MakeSegment.
  void BeginGrowth() { growing_ = true; }
  absl::StatusOr<ShmSegment> MakeSegment(const GrowthRequest& request) const;
  absl::Status EndGrowth(const GrowthRequest& request, absl::StatusOr<ShmSegment> made);

  // Growth ahead of need: the segment (segment_bytes) to make now for `uid`, whose segments hold
  // no free block of half a segment any more, so that its next creates find room without making
  // a segment on their path; grown with the protocol above. nullopt while growth is under way,
  // while `uid`'s segments still hold such a block (or it has none yet: its first segment is
  // made when it first creates), or when the pool is short: growth ahead never takes the pool's
  // last segment_bytes of capacity, nor its last segment id. Those stay for creates that need
  // them now, whatever their uid, since a segment grown for one uid holds only its buffers.
  std::optional<GrowthRequest> PlanAhead(uint32_t uid) const;

  // Returns `buffer` to its segment. REQUIRES: it came from Allocate and is not yet freed.
  void Free(const Buffer& buffer);

  // How many of `buffers` (allocated, in `uid`'s segments), freed in order, make Allocate(nbytes,
  // uid) fit in a segment made so far: the fewest that do, or -1 if freeing them all does not.
  // Changes nothing (tried on copies of the segments' free lists).
  int FreesToFit(uint64_t nbytes, uint32_t uid, absl::Span<const Buffer> buffers) const;

  // Whether `segment_id` names a live segment of the pool (not one a restart lost).
  bool HasSegment(uint64_t segment_id) const {
    return segment_id >= 1 && segment_id <= segments_.size() &&
           segments_[segment_id - 1].shm.has_value();
  }
  // Segment `segment_id`: its object, the uid whose buffers it holds, and the daemon instance
  // that created it. REQUIRES: HasSegment(segment_id).
  const ShmSegment& Segment(uint64_t segment_id) const;
  uint32_t SegmentOwner(uint64_t segment_id) const;
  uint64_t SegmentInstance(uint64_t segment_id) const;
  const std::string& SegmentName(uint64_t segment_id) const { return Segment(segment_id).name(); }
  uint64_t SegmentSize(uint64_t segment_id) const { return Segment(segment_id).size(); }

  uint64_t capacity_bytes() const { return options_.capacity_bytes; }
  SegmentBacking backing() const { return options_.backing; }
  uint32_t owner_uid() const { return options_.owner_uid; }
  uint64_t used_bytes() const;
  uint64_t reserved_bytes() const;  // bytes of all segments created so far
  // Segment ids run from 1 to segment_count(); a restart's holes among them are not HasSegment.
  size_t segment_count() const { return segments_.size(); }
  static uint64_t PageSize();

 private:
  struct PoolSegment {
    std::optional<ShmSegment> shm;  // empty: a memfd segment of the daemon before a restart
    BestFitAllocator allocator;
    uint32_t owner_uid;
    uint64_t instance;
    uint64_t size;  // as recorded: the object's size (a lost memfd's as its record said)
  };
  HostPool(HostPoolOptions options, ControlSegment* control)
      : options_(std::move(options)), control_(control) {}
  // The next segment for an allocation of `length` bytes for `uid`, if the capacity and the
  // segment table allow it; RESOURCE_EXHAUSTED (naming sizes) otherwise.
  absl::StatusOr<GrowthRequest> PlanSegment(uint64_t nbytes, uint64_t length, uint32_t uid) const;
  // The first segment: min(segment_bytes, capacity_bytes) bytes for the owner uid.
  GrowthRequest FirstSegment() const;
  // Creates and adds segment `request` at once (the pool's first segment, growth without a
  // GrowthRequest).
  absl::Status AddSegment(const GrowthRequest& request);
  void InstallSegment(const GrowthRequest& request, ShmSegment shm);

  HostPoolOptions options_;
  ControlSegment* control_;
  // The most recently freed buffer of `length` bytes for `uid` that is still free, taken out of
  // its segment's allocator; nullopt if none is.
  std::optional<Buffer> TakeRecentlyFreed(uint64_t length, uint32_t uid);

  static constexpr size_t kMaxHotPerLength = 16;
  static constexpr size_t kMaxHotLengths = 256;

  std::vector<PoolSegment> segments_;  // segments_[id - 1]
  bool growing_ = false;               // between BeginGrowth and EndGrowth
  // Buffers freed lately, by (uid, length), oldest first: Allocate prefers them (hot memory)
  // over a best fit elsewhere. A hint only: each is checked to be free before it is taken.
  std::map<std::pair<uint32_t, uint64_t>, std::vector<Buffer>> recently_freed_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_HOST_POOL_H_
