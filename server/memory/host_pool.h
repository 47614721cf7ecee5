// The host pool: shm segments (named or memfd), grown one at a time up to the configured
// capacity, each with a best-fit allocator. Every segment holds the buffers of one uid: each
// admitted uid gets segments of its own, so that a writable descriptor of a segment never exposes
// another uid's tensors. Another uid's segments are always memfds sealed against resizing,
// whatever the pool's backing: a descriptor it can write through must not let it shrink or grow
// an object others map (or that a restarted daemon checks); the price is that its tensors do not
// survive the daemon.
//
// Sharing between uids (docs/daemon.md, "How a pool is shared between uids"): the uids sharing the
// pool are those with an open session that has created host tensors, those whose segments hold live
// buffers, and the uid asking. A uid's segments never grow past its fair share, the capacity
// divided by that count; its segments grow in steps (the first min(segment size, max(capacity/4,
// 4 MiB)), then twice its largest segment, at most the segment size), each cut to what its share
// still allows. When a uid within its share needs room that the pool no longer has, empty
// segments (no live buffer, no stock) of other uids are given back first, then its own. A
// segment given back is unlinked at once and then emptied (its pages punched out, so clients still
// mapping it hold no memory) and closed by the caller outside its lock (BeginGrowth); its id is
// reused later under a new segment instance, so a client's mapping cached under the old
// (instance, id) never aliases the new object.
//
// Named segments are "/<prefix>.cpu.<id>", created exclusively (O_EXCL): a process of another uid
// that planted an object under that name (the prefix shows in /dev/shm) does not stop the pool
// growing; the segment takes a fresh random name instead ("/<prefix>.cpu.<id>.<16 hex digits>"),
// recorded in its SegmentRecord for a restarted daemon (see ObjectName).
#ifndef TENSORSHM_SERVER_MEMORY_HOST_POOL_H_
#define TENSORSHM_SERVER_MEMORY_HOST_POOL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/memory/allocator.h"
#include "server/memory/control_segment.h"
#include "server/memory/shm_segment.h"

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
  // --shm-group: the named segments (the owner uid's, "/<prefix>.cpu.<id>") are mode 0660 with
  // this group, and recovery takes back those of mode 0600 or of 0660 with this group; nullopt:
  // mode 0600, and recovery refuses 0660 (see ShmSegment). Memfd segments stay 0600.
  std::optional<gid_t> group;
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
  // BeginGrowth gives back the empty segments whose room the new segment needs (see the file
  // comment) and returns them, unlinked but not yet emptied: the caller passes them to
  // DisposeSegments outside its lock (emptying gigabytes takes a second or more).
  [[nodiscard]] std::vector<ShmSegment> BeginGrowth(const GrowthRequest& request) {
    MakeRoom(request);
    growing_ = true;
    return std::exchange(given_back_, {});
  }
  // A named segment takes its first name, or a random one if another object holds that (see the
  // file comment).
  absl::StatusOr<ShmSegment> MakeSegment(const GrowthRequest& request) const;
  absl::Status EndGrowth(const GrowthRequest& request, absl::StatusOr<ShmSegment> made);

  // Growth ahead of need: the segment (Step(uid), cut to its fair share) to make now for `uid`,
  // whose segments hold no free block of half its largest segment any more, so that its next
  // creates find room without making a segment on their path; grown with the protocol above.
  // nullopt while growth is under way, while `uid`'s segments still hold such a block (or it has
  // none yet: its first segment is made when it first creates), when its share is used up, or
  // when the pool is short: growth ahead gives no segment back, and never takes the pool's last
  // step of capacity, nor its last segment id. Those stay for creates that need them now,
  // whatever their uid, since a segment grown for one uid holds only its buffers.
  std::optional<GrowthRequest> PlanAhead(uint32_t uid) const;

  // Who shares the pool besides the uids whose segments hold buffers: `creating` returns the uids
  // with an open session that creates host tensors (called under the caller's lock; must not call
  // back into the pool). Without it only holders and the asking uid count.
  void set_creating_uids(std::function<std::set<uint32_t>()> creating) {
    creating_uids_ = std::move(creating);
  }
  // The bytes of segments `uid` may hold now: capacity / (number of uids sharing the pool,
  // counting `uid`), rounded down to whole pages.
  uint64_t FairShare(uint32_t uid) const;
  // The bytes of the segments holding `uid`'s buffers.
  uint64_t ReservedBy(uint32_t uid) const;
  // Segments given back so far (see the file comment).
  int64_t segments_given_back() const { return segments_given_back_; }
  // Empties (punches out) and closes segments given back (BeginGrowth). Needs no lock: it
  // touches only `segments`. Errors are logged.
  static void DisposeSegments(std::vector<ShmSegment> segments);

  // A uid that has gone keeps no memory it does not hold: the empty segments of uids other than
  // the daemon's with no session creating host tensors (set_creating_uids) are given back, and
  // returned for DisposeSegments outside the caller's lock. Nothing while growth is under way.
  // HasIdleSegments: whether there are such segments.
  [[nodiscard]] std::vector<ShmSegment> GiveBackIdle();
  bool HasIdleSegments() const;

  // The name of segment `segment_id`'s object: "/<prefix>.cpu.<segment_id>" for `suffix` 0, else
  // "/<prefix>.cpu.<segment_id>.<suffix as 16 lowercase hex digits>".
  static std::string ObjectName(const std::string& shm_prefix, uint64_t segment_id,
                                uint64_t suffix);

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
  uint64_t reserved_bytes() const;  // bytes the segments hold (Held), free ends given back aside
  // The largest tensor the pool could take now were its fair shares not counted: the largest
  // free block of a segment, or the room for a new segment (what no segment holds, the empty
  // segments and the free ends of segments in use, which are given back for it).
  uint64_t largest_free_bytes() const;
  // Segment ids run from 1 to segment_count(); a restart's holes among them are not HasSegment.
  size_t segment_count() const { return segments_.size(); }
  // The segments that exist now (Stat's figure): holes not counted.
  size_t live_segment_count() const {
    size_t live = 0;
    for (const PoolSegment& s : segments_) live += s.shm.has_value() ? 1 : 0;
    return live;
  }
  static uint64_t PageSize();

 private:
  struct PoolSegment {
    std::optional<ShmSegment> shm;  // empty: a memfd segment of the daemon before a restart
    BestFitAllocator allocator;
    uint32_t owner_uid;
    uint64_t instance;
    uint64_t size;             // as recorded: the object's size (a lost memfd's as its record said)
    uint64_t name_suffix = 0;  // see ObjectName; 0 for a memfd
  };
  // The bytes of `segment` the pool holds (what counts against the capacity): its allocator's
  // range, the object's size less a free end given back (TrimTail); 0 for a hole.
  static uint64_t Held(const PoolSegment& segment) {
    return segment.shm.has_value() ? segment.allocator.capacity() : 0;
  }
  // Gives the free end of segment `index` (in use, so not given back whole) back to the pool:
  // its allocator's range ends where the free end began, the record says so (SegmentRecord::held)
  // and the end's pages are punched out. Clients that map the segment keep their mappings (the
  // end reads as zeros); no buffer is placed there again.
  void TrimTail(size_t index);
  HostPool(HostPoolOptions options, ControlSegment* control)
      : options_(std::move(options)), control_(control) {}
  // The next segment for an allocation of `length` bytes for `uid`, if its fair share, the
  // capacity (counting the empty segments that can be given back) and the segment table allow
  // it; RESOURCE_EXHAUSTED (naming sizes) otherwise. Changes nothing: MakeRoom gives the
  // segments back when the growth begins.
  absl::StatusOr<GrowthRequest> PlanSegment(uint64_t nbytes, uint64_t length, uint32_t uid) const;
  // Gives back the empty segments whose room `request` (from PlanSegment or PlanAhead, with
  // nothing changed since) needs: first `uid`'s own if it would pass its share, then other
  // uids' (largest first), then its own; last, the free ends of `uid`'s segments in use
  // (TrimTail, largest first).
  void MakeRoom(const GrowthRequest& request);
  // The first segment: Step(owner uid) bytes for the owner uid.
  GrowthRequest FirstSegment() const;
  // The size of `uid`'s next segment before its share and the capacity cut it: the first step, or
  // twice its largest segment, at most the segment size.
  uint64_t Step(uint32_t uid) const;
  // The lowest id free for a new segment (a hole left by a segment given back or lost in a
  // restart, else the next one); 0 if the segment table is full.
  uint64_t FreeSegmentId() const;
  // Whether `segment` is live and holds no buffer.
  static bool IsEmpty(const PoolSegment& segment) {
    return segment.shm.has_value() &&
           segment.allocator.free_bytes() == segment.allocator.capacity();
  }
  // Gives empty segment `index` back (see the file comment) for `for_uid` (nullopt: because its
  // uid has gone, GiveBackIdle).
  void GiveBack(size_t index, std::optional<uint32_t> for_uid);
  // Whether `segment` is empty and belongs to a uid other than the daemon's that `creating` (the
  // uids with a session creating host tensors) does not name.
  bool IsIdle(const PoolSegment& segment, const std::set<uint32_t>& creating) const {
    return IsEmpty(segment) && segment.owner_uid != options_.owner_uid &&
           creating.count(segment.owner_uid) == 0;
  }
  // Creates and adds segment `request` at once (the pool's first segment, growth without a
  // GrowthRequest).
  absl::Status AddSegment(const GrowthRequest& request);
  void InstallSegment(const GrowthRequest& request, ShmSegment shm);
  // Removes the objects under "/<prefix>.cpu." that no live segment is: made by a daemon killed
  // before it recorded them (Recover). Only the daemon's own are removed (ShmSegment::Open
  // refuses others': a planted object is left where it is, and growth goes around it).
  void RemoveUnrecordedObjects() const;

  HostPoolOptions options_;
  ControlSegment* control_;
  // The most recently freed buffer of `length` bytes for `uid` that is still free, taken out of
  // its segment's allocator; nullopt if none is.
  std::optional<Buffer> TakeRecentlyFreed(uint64_t length, uint32_t uid);

  static constexpr size_t kMaxHotPerLength = 16;
  static constexpr size_t kMaxHotLengths = 256;

  std::vector<PoolSegment> segments_;  // segments_[id - 1]
  bool growing_ = false;               // between BeginGrowth and EndGrowth
  std::function<std::set<uint32_t>()> creating_uids_;
  int64_t segments_given_back_ = 0;
  std::vector<ShmSegment> given_back_;  // by GiveBack, until BeginGrowth hands them out
  uint64_t reused_ids_ = 0;  // ids reused so far: each reuse gets a segment instance of its own
  // Buffers freed lately, by (uid, length), oldest first: Allocate prefers them (hot memory)
  // over a best fit elsewhere. A hint only: each is checked to be free before it is taken.
  std::map<std::pair<uint32_t, uint64_t>, std::vector<Buffer>> recently_freed_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_MEMORY_HOST_POOL_H_
