// How the host pool is shared between uids and grows: each uid's fair share, the size of its next
// segment (Step), growth planned for a create or ahead of need, and segments given back (a uid
// past its share, a uid that has gone).
#include <algorithm>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "server/memory/host_pool.h"
#include "server/ops/log.h"

namespace tensorshm {

uint64_t HostPool::Step(uint32_t uid) const {
  constexpr uint64_t kMinFirstStep = uint64_t{4} << 20;
  const uint64_t page = PageSize();
  const uint64_t capacity = options_.capacity_bytes;
  const uint64_t most = std::min(options_.segment_bytes, capacity);
  uint64_t largest = 0;
  for (const PoolSegment& s : segments_) {
    if (s.shm && s.owner_uid == uid) largest = std::max(largest, s.size);
  }
  const uint64_t first = std::max(capacity / 4 / page * page, kMinFirstStep);
  return std::min(most, largest == 0 ? first : std::max(first, 2 * largest));
}

uint64_t HostPool::FairShare(uint32_t uid) const {
  std::set<uint32_t> sharing = creating_uids_ ? creating_uids_() : std::set<uint32_t>{};
  sharing.insert(uid);
  for (const PoolSegment& s : segments_) {
    if (s.shm && !IsEmpty(s)) sharing.insert(s.owner_uid);
  }
  const uint64_t page = PageSize();
  return options_.capacity_bytes / sharing.size() / page * page;
}

uint64_t HostPool::ReservedBy(uint32_t uid) const {
  uint64_t reserved = 0;
  for (const PoolSegment& s : segments_) {
    if (s.owner_uid == uid) reserved += Held(s);
  }
  return reserved;
}

uint64_t HostPool::FreeSegmentId() const {
  for (size_t i = 0; i < segments_.size(); ++i) {
    if (!segments_[i].shm) return i + 1;
  }
  return segments_.size() < kMaxSegments ? segments_.size() + 1 : 0;
}

void HostPool::GiveBack(size_t index, std::optional<uint32_t> for_uid) {
  PoolSegment& segment = segments_[index];
  TSM_CHECK(IsEmpty(segment));
  const uint64_t id = index + 1;
  // The record first: a daemon killed from here on recovers a hole, never a live record of an
  // object that is gone. The state before the size, as a hole's record is read.
  SegmentRecord& record = control_->segment(static_cast<uint32_t>(index));
  record.state.store(static_cast<uint32_t>(SegmentState::kEphemeral), std::memory_order_release);
  record.size = 0;
  record.held = 0;
  record.name_suffix = 0;
  TSM_LOG(kInfo) << "host pool: segment " << id << " (" << Held(segment) << " bytes) of uid "
                 << segment.owner_uid << " is empty; given back to the pool "
                 << (for_uid.has_value()
                         ? absl::StrCat("for uid ", *for_uid)
                         : std::string("(the uid has no session creating tensors)"));
  // Its name goes now (a segment made in its place may take it); its pages go in
  // DisposeSegments, outside the caller's lock.
  segment.shm->Unlink();
  given_back_.push_back(*std::move(segment.shm));
  segment.shm.reset();
  segment.allocator = BestFitAllocator(0);
  segment.size = 0;
  segment.name_suffix = 0;
  for (auto it = recently_freed_.begin(); it != recently_freed_.end();) {
    std::vector<Buffer>& hot = it->second;
    hot.erase(std::remove_if(hot.begin(), hot.end(),
                             [id](const Buffer& b) { return b.segment_id == id; }),
              hot.end());
    it = hot.empty() ? recently_freed_.erase(it) : std::next(it);
  }
  ++segments_given_back_;
}

std::vector<ShmSegment> HostPool::GiveBackIdle() {
  if (growing_) return {};
  const std::set<uint32_t> creating = creating_uids_ ? creating_uids_() : std::set<uint32_t>{};
  for (size_t i = 0; i < segments_.size(); ++i) {
    if (IsIdle(segments_[i], creating)) GiveBack(i, std::nullopt);
  }
  return std::exchange(given_back_, {});
}

bool HostPool::HasIdleSegments() const {
  if (growing_) return false;
  const std::set<uint32_t> creating = creating_uids_ ? creating_uids_() : std::set<uint32_t>{};
  for (const PoolSegment& segment : segments_) {
    if (IsIdle(segment, creating)) return true;
  }
  return false;
}

absl::StatusOr<GrowthRequest> HostPool::PlanSegment(uint64_t nbytes, uint64_t length,
                                                    uint32_t uid) const {
  const uint64_t capacity = options_.capacity_bytes;
  const uint64_t share = FairShare(uid);
  const uint64_t mine = ReservedBy(uid);
  uint64_t mine_empty = 0;    // bytes of `uid`'s empty segments (each too small for `length`)
  uint64_t mine_ends = 0;     // bytes of the free ends of `uid`'s segments in use (TrimTail)
  uint64_t others_empty = 0;  // bytes of other uids' empty segments
  uint64_t largest = 0;       // largest free block in `uid`'s segments
  uint64_t free_in_mine = 0;
  for (const PoolSegment& s : segments_) {
    if (!s.shm) continue;
    if (s.owner_uid == uid) {
      largest = std::max(largest, s.allocator.largest_free_block());
      free_in_mine += s.allocator.free_bytes();
      if (IsEmpty(s)) {
        mine_empty += Held(s);
      } else {
        mine_ends += s.allocator.free_tail();
      }
    } else if (IsEmpty(s)) {
      others_empty += Held(s);
    }
  }
  const uint64_t remaining = capacity - reserved_bytes();
  // The most `uid` may hold once its own empty segments and free ends are given back, and the
  // room the pool can make: what no segment holds, what empty segments give back, and the free
  // ends of `uid`'s segments (a pool of segments made one after another would otherwise keep
  // the end of each, too small for the next buffer, and hold less than its size).
  const uint64_t kept = mine - mine_empty - mine_ends;
  const uint64_t share_left = share > kept ? share - kept : 0;
  const uint64_t room = remaining + others_empty + mine_empty + mine_ends;
  if (share_left < length || room < length) {
    const uint64_t free_for_uid =
        std::min(share_left, room) + free_in_mine - mine_empty - mine_ends;
    return absl::ResourceExhaustedError(absl::StrCat(
        "host pool: cannot allocate ", nbytes, " bytes (", length, " rounded to pages) for uid ",
        uid, ": ", free_for_uid, " of ", capacity, " bytes free to it, largest free block ",
        std::max(largest, std::min(share_left, room)), " bytes; its segments hold ", mine,
        " bytes of its fair share of ", share,
        " (each uid's buffers take segments of their own, and the pool is shared evenly between "
        "the uids creating tensors)"));
  }
  if (FreeSegmentId() == 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host pool: all ", kMaxSegments, " segments in use; raise --segment-size"));
  }
  // Within its share: a step, cut to what the share allows. Past it (its empty segments count):
  // just the buffer, once its own empty segments are given back.
  const bool within_share = mine <= share && length <= share - mine;
  uint64_t size = within_share ? std::max(length, std::min(Step(uid), share - mine)) : length;
  // Free ends go only when nothing else makes the room: they may still take smaller buffers.
  size = std::min(size, std::max(length, remaining + others_empty + mine_empty));
  // Empty segments and free ends that must go to make the room go when the growth begins
  // (MakeRoom), not now: a caller may not go on with this plan (stock never grows a pool).
  size = std::min(size, room);
  TSM_CHECK(size >= length);
  GrowthRequest request;
  request.needed = true;
  request.segment_id = FreeSegmentId();
  request.size = size;
  request.uid = uid;
  return request;
}

void HostPool::MakeRoom(const GrowthRequest& request) {
  const uint32_t uid = request.uid;
  // The segment of `uid`'s in use with the largest free end; -1 if none has one.
  auto largest_end = [this, uid] {
    int pick = -1;
    for (size_t i = 0; i < segments_.size(); ++i) {
      const PoolSegment& s = segments_[i];
      if (!s.shm || s.owner_uid != uid || IsEmpty(s) || s.allocator.free_tail() == 0) continue;
      if (pick < 0 || s.allocator.free_tail() > segments_[pick].allocator.free_tail()) {
        pick = static_cast<int>(i);
      }
    }
    return pick;
  };
  if (ReservedBy(uid) + request.size > FairShare(uid)) {
    // Past its share only with its own empty segments (each too small for the buffer): they go,
    // then the free ends of its segments, as many as it takes.
    for (size_t i = 0; i < segments_.size(); ++i) {
      if (IsEmpty(segments_[i]) && segments_[i].owner_uid == uid) GiveBack(i, uid);
    }
    for (int end = largest_end(); end >= 0 && ReservedBy(uid) + request.size > FairShare(uid);
         end = largest_end()) {
      TrimTail(static_cast<size_t>(end));
    }
  }
  // Then other uids' empty segments (largest first), then its own, as many as the segment needs.
  for (const bool own : {false, true}) {
    while (options_.capacity_bytes - reserved_bytes() < request.size) {
      int pick = -1;
      for (size_t i = 0; i < segments_.size(); ++i) {
        const PoolSegment& s = segments_[i];
        if (!IsEmpty(s) || (s.owner_uid == uid) != own) continue;
        if (pick < 0 || s.size > segments_[pick].size) pick = static_cast<int>(i);
      }
      if (pick < 0) break;
      GiveBack(static_cast<size_t>(pick), uid);
    }
  }
  // Last, the free ends of its segments in use (largest first).
  for (int end = largest_end();
       end >= 0 && options_.capacity_bytes - reserved_bytes() < request.size; end = largest_end()) {
    TrimTail(static_cast<size_t>(end));
  }
  // PlanSegment saw the room, and nothing changed since (the caller's lock is held throughout).
  TSM_CHECK(options_.capacity_bytes - reserved_bytes() >= request.size);
  TSM_CHECK(request.segment_id >= 1 && request.segment_id <= segments_.size() + 1 &&
            (request.segment_id > segments_.size() || !segments_[request.segment_id - 1].shm));
}

void HostPool::TrimTail(size_t index) {
  PoolSegment& segment = segments_[index];
  TSM_CHECK(segment.shm.has_value() && !IsEmpty(segment));
  const uint64_t end = segment.allocator.free_tail();
  TSM_CHECK(end > 0);
  const uint64_t held = segment.allocator.capacity() - end;
  // The record first: a daemon killed from here on recovers the segment without its end (its
  // pages wasted until the segment is given back, never counted twice).
  control_->segment(static_cast<uint32_t>(index)).held = held;
  // Buffers of the end still in recently_freed_ are never taken: TakeRecentlyFreed reserves each
  // in its allocator first, which now refuses the end.
  segment.allocator.TrimTail();
  const uint64_t id = index + 1;
  TSM_LOG(kInfo) << "host pool: the free end of segment " << id << " of uid " << segment.owner_uid
                 << " (" << end << " bytes after its first " << held
                 << ") given back for a new segment";
  if (absl::Status s = segment.shm->Discard(held, end); !s.ok()) {
    TSM_LOG(kWarning) << "host pool: emptying the end of segment " << id << ": " << s;
  }
}

std::optional<GrowthRequest> HostPool::PlanAhead(uint32_t uid) const {
  if (growing_) return std::nullopt;
  // The last free id stays for a create that needs it.
  size_t free_ids = kMaxSegments - segments_.size();
  for (const PoolSegment& s : segments_) free_ids += s.shm ? 0 : 1;
  if (free_ids < 2) return std::nullopt;
  uint64_t largest_own = 0;
  for (const PoolSegment& s : segments_) {
    if (s.shm && s.owner_uid == uid) largest_own = std::max(largest_own, s.size);
  }
  if (largest_own == 0) return std::nullopt;
  for (const PoolSegment& s : segments_) {
    if (s.shm && s.owner_uid == uid && s.allocator.largest_free_block() >= largest_own / 2) {
      return std::nullopt;
    }
  }
  const uint64_t share = FairShare(uid);
  const uint64_t mine = ReservedBy(uid);
  if (mine >= share) return std::nullopt;
  const uint64_t size = std::min(Step(uid), share - mine);
  const uint64_t remaining = options_.capacity_bytes - reserved_bytes();
  if (remaining < size || remaining - size < size) return std::nullopt;
  GrowthRequest request;
  request.needed = true;
  request.segment_id = FreeSegmentId();
  request.size = size;
  request.uid = uid;
  return request;
}

}  // namespace tensorshm
