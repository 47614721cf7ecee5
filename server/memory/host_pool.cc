#include "server/memory/host_pool.h"

#include <dirent.h>
#include <dlpack/dlpack.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/shm/tensor_record.h"
#include "server/ops/log.h"

namespace tensorshm {

uint64_t HostPool::PageSize() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

absl::StatusOr<HostPool> HostPool::Create(const HostPoolOptions& options, ControlSegment* control) {
  const uint64_t page = PageSize();
  if (options.capacity_bytes == 0 || options.capacity_bytes % page != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host pool size = ", options.capacity_bytes,
                     ": must be a positive multiple of the page size (", page, ")"));
  }
  if (options.segment_bytes == 0 || options.segment_bytes % page != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment size = ", options.segment_bytes,
                     ": must be a positive multiple of the page size (", page, ")"));
  }
  HostPool pool(options, control);
  if (absl::Status s = pool.AddSegment(pool.FirstSegment()); !s.ok()) return s;
  return pool;
}

absl::StatusOr<HostPool> HostPool::Recover(const HostPoolOptions& options,
                                           ControlSegment* control) {
  HostPool pool(options, control);
  for (uint32_t index = 0; index < kMaxSegments; ++index) {
    // Copied once: another process may write the segment while it is read (see CopyRecord).
    control->segment(index).state.load(std::memory_order_acquire);
    SegmentRecord record;
    CopyRecord(control->segment(index), record);
    const auto state = static_cast<SegmentState>(record.state.load(std::memory_order_relaxed));
    if (state != SegmentState::kLive && state != SegmentState::kEphemeral) {
      break;  // segments are added in order; the first unused one ends the list
    }
    if (state == SegmentState::kEphemeral) {
      // A memfd ended with the old daemon: its id stays taken, its tensors are dropped.
      pool.segments_.push_back(PoolSegment{std::nullopt, BestFitAllocator(0), record.owner_uid,
                                           record.instance, record.size});
      continue;
    }
    const std::string name = ObjectName(options.shm_prefix, index + 1, record.name_suffix);
    // A failed recovery leaves every object where it was, for a later start (or the operator)
    // to deal with: the segments opened so far are kept, not unlinked with the pool.
    auto fail = [&pool](absl::Status status) {
      pool.KeepSegments();
      return status;
    };
    if (record.segment_id != index + 1) {
      return fail(absl::DataLossError(absl::StrCat("segment record ", index, ": segment_id ",
                                                   record.segment_id, ", expected ", index + 1)));
    }
    absl::StatusOr<ShmSegment> shm = ShmSegment::Open(name, /*map=*/false);
    if (!shm.ok()) return fail(shm.status());
    if (shm->size() != record.size) {
      shm->Keep();
      return fail(absl::DataLossError(
          absl::StrCat(name, ": ", shm->size(), " bytes, the catalog recorded ", record.size)));
    }
    // The same object as before: clients keep the instance that created it as its key.
    pool.segments_.push_back(PoolSegment{*std::move(shm), BestFitAllocator(record.size),
                                         record.owner_uid, record.instance, record.size,
                                         record.name_suffix});
  }
  pool.RemoveUnrecordedObjects();
  if (pool.segments_.empty()) {
    if (absl::Status s = pool.AddSegment(pool.FirstSegment()); !s.ok()) return s;
  }
  return pool;
}

void HostPool::RemoveUnrecordedObjects() const {
  std::set<std::string> live;
  for (const PoolSegment& segment : segments_) {
    if (segment.shm) live.insert(segment.shm->name().substr(1));
  }
  const std::string start = absl::StrCat(options_.shm_prefix, ".cpu.");
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  std::vector<std::string> unrecorded;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (absl::StartsWith(name, start) && live.count(name) == 0) unrecorded.push_back(name);
  }
  closedir(dir);
  for (const std::string& name : unrecorded) {
    // A daemon killed between making a segment and recording it left the object behind: ours
    // (Open checks the owner and mode; anyone else's is refused and left), recorded nowhere, it
    // goes.
    if (absl::StatusOr<ShmSegment> orphan = ShmSegment::Open("/" + name, /*map=*/false);
        orphan.ok()) {
      TSM_LOG(kWarning) << "recovery: /" << name << " (" << orphan->size()
                        << " bytes) is recorded nowhere, made by a daemon killed before it "
                           "recorded it; removed";
    } else {
      TSM_LOG(kInfo) << "recovery: left alone (segments are made around it): " << orphan.status();
    }  // unlinked as `orphan` goes
  }
}

bool HostPool::Reserve(const Buffer& buffer) {
  if (!HasSegment(buffer.segment_id)) return false;
  return segments_[buffer.segment_id - 1].allocator.Reserve(buffer.offset, buffer.length);
}

int HostPool::RepairSegmentRecords() const {
  int repaired = 0;
  for (uint32_t index = 0; index < kMaxSegments; ++index) {
    SegmentRecord& record = control_->segment(index);
    if (index >= segments_.size()) {
      if (record.state.load(std::memory_order_relaxed) !=
          static_cast<uint32_t>(SegmentState::kUnused)) {
        record.state.store(static_cast<uint32_t>(SegmentState::kUnused), std::memory_order_release);
        ++repaired;
      }
      continue;
    }
    const PoolSegment& segment = segments_[index];
    const SegmentState state =
        segment.shm.has_value() && segment.shm->backing() == SegmentBacking::kNamed
            ? SegmentState::kLive
            : SegmentState::kEphemeral;
    SegmentRecord found;
    CopyRecord(record, found);
    if (found.state.load(std::memory_order_relaxed) == static_cast<uint32_t>(state) &&
        found.device_type == kDLCPU && found.device_id == 0 &&
        found.owner_uid == segment.owner_uid && found.segment_id == index + 1 &&
        found.size == segment.size && found.instance == segment.instance &&
        found.name_suffix == segment.name_suffix) {
      continue;
    }
    // The state last, as AddSegment writes it (never unused in between: a recovery would stop
    // there).
    record.device_type = kDLCPU;
    record.device_id = 0;
    record.owner_uid = segment.owner_uid;
    record.segment_id = index + 1;
    record.size = segment.size;
    record.instance = segment.instance;
    record.name_suffix = segment.name_suffix;
    record.state.store(static_cast<uint32_t>(state), std::memory_order_release);
    ++repaired;
  }
  return repaired;
}

void HostPool::KeepSegments() {
  for (PoolSegment& segment : segments_) {
    if (segment.shm) segment.shm->Keep();
  }
}

GrowthRequest HostPool::FirstSegment() const {
  GrowthRequest request;
  request.needed = true;
  request.segment_id = segments_.size() + 1;
  request.size = Step(options_.owner_uid);
  request.uid = options_.owner_uid;
  return request;
}

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
    if (s.shm && s.owner_uid == uid) reserved += s.size;
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
  record.name_suffix = 0;
  TSM_LOG(kInfo) << "host pool: segment " << id << " (" << segment.size << " bytes) of uid "
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
  uint64_t others_empty = 0;  // bytes of other uids' empty segments
  uint64_t largest = 0;       // largest free block in `uid`'s segments
  uint64_t free_in_mine = 0;
  for (const PoolSegment& s : segments_) {
    if (!s.shm) continue;
    if (s.owner_uid == uid) {
      largest = std::max(largest, s.allocator.largest_free_block());
      free_in_mine += s.allocator.free_bytes();
      if (IsEmpty(s)) mine_empty += s.size;
    } else if (IsEmpty(s)) {
      others_empty += s.size;
    }
  }
  const uint64_t remaining = capacity - reserved_bytes();
  // The most `uid` may hold once its own empty segments are given back, and the room the pool
  // can make: what no segment holds, and what empty segments give back.
  const uint64_t share_left = share > mine - mine_empty ? share - (mine - mine_empty) : 0;
  const uint64_t room = remaining + others_empty + mine_empty;
  if (share_left < length || room < length) {
    const uint64_t free_for_uid = std::min(share_left, room) + free_in_mine - mine_empty;
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
  // Empty segments that must go to make the room go when the growth begins (MakeRoom), not now:
  // a caller may not go on with this plan (stock never grows a pool).
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
  if (ReservedBy(uid) + request.size > FairShare(uid)) {
    // Past its share only with its own empty segments (each too small for the buffer): they go.
    for (size_t i = 0; i < segments_.size(); ++i) {
      if (IsEmpty(segments_[i]) && segments_[i].owner_uid == uid) GiveBack(i, uid);
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
  // PlanSegment saw the room, and nothing changed since (the caller's lock is held throughout).
  TSM_CHECK(options_.capacity_bytes - reserved_bytes() >= request.size);
  TSM_CHECK(request.segment_id >= 1 && request.segment_id <= segments_.size() + 1 &&
            (request.segment_id > segments_.size() || !segments_[request.segment_id - 1].shm));
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

std::string HostPool::ObjectName(const std::string& shm_prefix, uint64_t segment_id,
                                 uint64_t suffix) {
  std::string name = absl::StrCat("/", shm_prefix, ".cpu.", segment_id);
  if (suffix != 0) absl::StrAppend(&name, ".", absl::Hex(suffix, absl::kZeroPad16));
  return name;
}

void HostPool::DisposeSegments(std::vector<ShmSegment> segments) {
  for (ShmSegment& segment : segments) {
    // Clients may still map it (a producer's writable mapping, consumers' cached ones): its pages
    // go now, whoever maps it; the object itself goes with its last mapping.
    if (absl::Status s = segment.Discard(); !s.ok()) {
      TSM_LOG(kWarning) << "host pool: emptying a segment given back: " << s;
    }
  }
}  // closed as `segments` goes

absl::StatusOr<ShmSegment> HostPool::MakeSegment(const GrowthRequest& request) const {
  const SegmentBacking backing =
      request.uid == options_.owner_uid ? options_.backing : SegmentBacking::kMemfd;
  const std::string first = ObjectName(options_.shm_prefix, request.segment_id, 0);
  absl::StatusOr<ShmSegment> made = ShmSegment::Create(first, request.size, /*map=*/false, backing);
  if (backing != SegmentBacking::kNamed || !absl::IsAlreadyExists(made.status())) return made;
  // Another process holds the name (another uid may create any name in /dev/shm, and the prefix
  // shows there): the segment takes a name nobody can guess instead. Each try is exclusive, so
  // a name taken meanwhile is just another try.
  struct stat planted;
  const bool seen = lstat(absl::StrCat("/dev/shm", first).c_str(), &planted) == 0;
  std::random_device random;  // the kernel's entropy pool
  for (int attempt = 0; attempt < 8 && absl::IsAlreadyExists(made.status()); ++attempt) {
    uint64_t suffix = 0;
    while (suffix == 0) suffix = (uint64_t{random()} << 32) | random();
    made = ShmSegment::Create(ObjectName(options_.shm_prefix, request.segment_id, suffix),
                              request.size, /*map=*/false, backing);
  }
  if (made.ok()) {
    TSM_LOG(kWarning) << "host pool: /dev/shm" << first << " exists already"
                      << (seen ? absl::StrCat(" (owned by uid ", planted.st_uid, ")") : "")
                      << ", not made by this daemon; segment " << request.segment_id << " is "
                      << made->name() << " instead";
  }
  return made;
}

absl::Status HostPool::EndGrowth(const GrowthRequest& request, absl::StatusOr<ShmSegment> made) {
  TSM_CHECK(growing_);
  growing_ = false;
  if (!made.ok()) return made.status();
  InstallSegment(request, *std::move(made));
  return absl::OkStatus();
}

absl::Status HostPool::AddSegment(const GrowthRequest& request) {
  MakeRoom(request);
  DisposeSegments(std::exchange(given_back_, {}));
  absl::StatusOr<ShmSegment> shm = MakeSegment(request);
  if (!shm.ok()) return shm.status();
  InstallSegment(request, *std::move(shm));
  return absl::OkStatus();
}

void HostPool::InstallSegment(const GrowthRequest& request, ShmSegment shm) {
  // One grower at a time, and nothing else adds segments meanwhile: the id is still free.
  const uint64_t id = request.segment_id;
  TSM_CHECK(id >= 1 && id <= segments_.size() + 1);
  const SegmentBacking backing = shm.backing();
  uint64_t instance = options_.instance;
  const std::string first = ObjectName(options_.shm_prefix, id, 0);
  uint64_t suffix = 0;
  if (backing == SegmentBacking::kNamed && shm.name() != first) {
    // MakeSegment took a random name: first + "." + 16 hex digits.
    TSM_CHECK(shm.name().size() == first.size() + 17 &&
              absl::SimpleHexAtoi(absl::string_view(shm.name()).substr(first.size() + 1), &suffix));
  }
  PoolSegment made{
      std::move(shm), BestFitAllocator(request.size), request.uid, instance, request.size, suffix};
  if (id <= segments_.size()) {
    // A hole's id, reused: under an instance of its own, so that no client's mapping of the
    // object it named before (keyed by instance and id) is taken for this one.
    TSM_CHECK(!segments_[id - 1].shm.has_value());
    ++reused_ids_;
    instance = options_.instance + reused_ids_ * 0x9e3779b97f4a7c15ull;
    made.instance = instance;
    segments_[id - 1] = std::move(made);
  } else {
    segments_.push_back(std::move(made));
  }
  SegmentRecord& record = control_->segment(static_cast<uint32_t>(id - 1));
  // A hole's record says kEphemeral (never unused in between: a recovery would stop there).
  record.device_type = kDLCPU;
  record.device_id = 0;
  record.owner_uid = request.uid;
  record.segment_id = id;
  record.size = request.size;
  record.instance = instance;
  record.name_suffix = suffix;
  record.state.store(
      static_cast<uint32_t>(backing == SegmentBacking::kNamed ? SegmentState::kLive
                                                              : SegmentState::kEphemeral),
      std::memory_order_release);
}

absl::StatusOr<Buffer> HostPool::Allocate(uint64_t nbytes, uint32_t uid, GrowthRequest* growth) {
  TSM_CHECK(nbytes > 0);
  const uint64_t page = PageSize();
  if (nbytes > options_.capacity_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host pool: cannot allocate ", nbytes, " bytes: larger than the whole pool (",
                     options_.capacity_bytes, " bytes, --host-pool)"));
  }
  const uint64_t length = (nbytes + page - 1) / page * page;
  if (std::optional<Buffer> hot = TakeRecentlyFreed(length, uid)) return *hot;
  const int index = BestFitSegment(
      segments_, length, [uid](const PoolSegment& s) { return s.shm && s.owner_uid == uid; });
  PoolSegment* best = index < 0 ? nullptr : &segments_[index];
  if (best == nullptr) {
    absl::StatusOr<GrowthRequest> plan = PlanSegment(nbytes, length, uid);
    if (!plan.ok()) return plan.status();
    if (growth != nullptr) {
      if (growing_) {
        growth->busy = true;
      } else {
        *growth = *plan;
      }
      return absl::UnavailableError("host pool: a new segment must be made first");
    }
    TSM_CHECK(!growing_);
    if (absl::Status s = AddSegment(*plan); !s.ok()) return s;
    best = &segments_[plan->segment_id - 1];
  }
  std::optional<uint64_t> offset = best->allocator.Allocate(length);
  TSM_CHECK(offset.has_value());
  // Not cleared: the segment holds only `uid`'s buffers, so what shows through is zeros or that
  // uid's own leftovers, and the producer's warm pages stay in its page table (clearing would
  // cost a write, or a hole punched and faulted in again, of every page).
  return Buffer{static_cast<uint64_t>(best - segments_.data()) + 1, *offset, length};
}

void HostPool::Free(const Buffer& buffer) {
  TSM_CHECK(buffer.segment_id >= 1 && buffer.segment_id <= segments_.size());
  PoolSegment& segment = segments_[buffer.segment_id - 1];
  segment.allocator.Free(buffer.offset, buffer.length);
  // Remembered as hot: its pages are likely still in the producer's page table and caches.
  if (recently_freed_.size() >= kMaxHotLengths &&
      recently_freed_.count({segment.owner_uid, buffer.length}) == 0) {
    recently_freed_.clear();  // many lengths: forget them all rather than track an LRU
  }
  std::vector<Buffer>& hot = recently_freed_[{segment.owner_uid, buffer.length}];
  if (hot.size() >= kMaxHotPerLength) hot.erase(hot.begin());
  hot.push_back(buffer);
}

std::optional<Buffer> HostPool::TakeRecentlyFreed(uint64_t length, uint32_t uid) {
  auto it = recently_freed_.find({uid, length});
  if (it == recently_freed_.end()) return std::nullopt;
  std::vector<Buffer>& hot = it->second;
  std::optional<Buffer> taken;
  while (!hot.empty() && !taken.has_value()) {
    const Buffer buffer = hot.back();
    hot.pop_back();
    // Still free (not merged into a block handed out since): take exactly it.
    if (HasSegment(buffer.segment_id) && SegmentOwner(buffer.segment_id) == uid &&
        segments_[buffer.segment_id - 1].allocator.Reserve(buffer.offset, buffer.length)) {
      taken = buffer;
    }
  }
  if (hot.empty()) recently_freed_.erase(it);
  return taken;
}

int HostPool::FreesToFit(uint64_t nbytes, uint32_t uid, absl::Span<const Buffer> buffers) const {
  const uint64_t page = PageSize();
  const uint64_t length = (nbytes + page - 1) / page * page;
  for (const Buffer& buffer : buffers) {
    TSM_CHECK(HasSegment(buffer.segment_id) && SegmentOwner(buffer.segment_id) == uid);
  }
  return FreesToFitLength(length, buffers, [this](uint64_t segment_id) -> const BestFitAllocator& {
    return segments_[segment_id - 1].allocator;
  });
}

const ShmSegment& HostPool::Segment(uint64_t segment_id) const {
  TSM_CHECK(HasSegment(segment_id));
  return *segments_[segment_id - 1].shm;
}

uint32_t HostPool::SegmentOwner(uint64_t segment_id) const {
  TSM_CHECK(HasSegment(segment_id));
  return segments_[segment_id - 1].owner_uid;
}

uint64_t HostPool::SegmentInstance(uint64_t segment_id) const {
  TSM_CHECK(HasSegment(segment_id));
  return segments_[segment_id - 1].instance;
}

uint64_t HostPool::used_bytes() const {
  uint64_t used = 0;
  for (const PoolSegment& s : segments_) {
    used += s.allocator.capacity() - s.allocator.free_bytes();
  }
  return used;
}

uint64_t HostPool::reserved_bytes() const {
  uint64_t reserved = 0;
  for (const PoolSegment& s : segments_) reserved += s.shm ? s.shm->size() : 0;
  return reserved;
}

}  // namespace tensorshm
