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
#include "server/memory/pool_refusal.h"
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
    absl::StatusOr<ShmSegment> shm = ShmSegment::Open(name, /*map=*/false, options.group);
    if (!shm.ok()) return fail(shm.status());
    if (shm->size() != record.size) {
      shm->Keep();
      return fail(absl::DataLossError(
          absl::StrCat(name, ": ", shm->size(), " bytes, the catalog recorded ", record.size)));
    }
    // Its free end given back before the restart stays given back (the pages are gone).
    const uint64_t held = record.held == 0 ? record.size : record.held;
    if (held > record.size || held % PageSize() != 0) {
      shm->Keep();
      return fail(absl::DataLossError(
          absl::StrCat("segment record ", index, ": held ", held, " of ", record.size, " bytes")));
    }
    // The same object as before: clients keep the instance that created it as its key.
    pool.segments_.push_back(PoolSegment{*std::move(shm), BestFitAllocator(held), record.owner_uid,
                                         record.instance, record.size, record.name_suffix});
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
    if (absl::StatusOr<ShmSegment> orphan =
            ShmSegment::Open("/" + name, /*map=*/false, options_.group);
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
        found.size == segment.size && found.held == Held(segment) &&
        found.instance == segment.instance && found.name_suffix == segment.name_suffix) {
      continue;
    }
    // The state last, as AddSegment writes it (never unused in between: a recovery would stop
    // there).
    record.device_type = kDLCPU;
    record.device_id = 0;
    record.owner_uid = segment.owner_uid;
    record.segment_id = index + 1;
    record.size = segment.size;
    record.held = Held(segment);
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
  // Only a named segment can be opened by name (--shm-group's purpose); a memfd stays 0600.
  const std::optional<gid_t> group =
      backing == SegmentBacking::kNamed ? options_.group : std::nullopt;
  const std::string first = ObjectName(options_.shm_prefix, request.segment_id, 0);
  absl::StatusOr<ShmSegment> made =
      ShmSegment::Create(first, request.size, /*map=*/false, backing, group);
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
                              request.size, /*map=*/false, backing, group);
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
  record.held = request.size;
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
    return NeverFitsError(absl::StrCat("host pool: cannot allocate ", nbytes,
                                       " bytes: larger than the whole pool (",
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
  for (const PoolSegment& s : segments_) reserved += Held(s);
  return reserved;
}

uint64_t HostPool::largest_free_bytes() const {
  uint64_t largest = 0;
  uint64_t room = options_.capacity_bytes - reserved_bytes();
  for (const PoolSegment& s : segments_) {
    if (!s.shm) continue;
    largest = std::max(largest, s.allocator.largest_free_block());
    room += IsEmpty(s) ? Held(s) : s.allocator.free_tail();
  }
  return std::max(largest, room);
}

}  // namespace tensorshm
