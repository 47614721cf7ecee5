#include "client/segment_map.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/sealed_ranges.h"
#include "common/base/sys_error.h"

namespace tensorshm {
namespace {

uint64_t PageBytes() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

std::string SegmentLabel(const SegmentKey& key) {
  return absl::StrFormat("segment %d (instance %016x)", key.second, key.first);
}

SegmentMapping::SegmentMapping(Mapping mapping, SegmentKey key, std::string shm_name)
    : mapping_(std::move(mapping)), key_(key), shm_name_(std::move(shm_name)) {
  if (mapping_.valid()) {
    sealed_ranges::AddSegment(mapping_.data(), mapping_.size(), key_.first, key_.second);
  }
}

SegmentMapping::~SegmentMapping() {
  if (mapping_.valid()) sealed_ranges::RemoveSegment(mapping_.data());
}

void SegmentMapping::Populate() const {
  madvise(mapping_.data(), mapping_.size(), MADV_POPULATE_READ);
}

WritableSegment::WritableSegment(Mapping mapping, SegmentKey key, std::string shm_name, UniqueFd fd)
    : mapping_(std::move(mapping)),
      fd_(std::move(fd)),
      address_(mapping_.data()),
      size_(mapping_.size()),
      key_(key),
      label_(SegmentLabel(key)),
      shm_name_(std::move(shm_name)) {
  MutexLock lock(&mu_);
  populated_.assign((size_ + PageBytes() - 1) / PageBytes(), false);
  if (mapping_.valid()) sealed_ranges::AddSegment(address_, size_, key_.first, key_.second);
}

absl::StatusOr<UniqueFd> WritableSegment::DupDescriptor() const {
  UniqueFd fd(fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError("fcntl(F_DUPFD_CLOEXEC)", label_, errno);
  return fd;
}

WritableSegment::~WritableSegment() {
  if (mapping_.valid()) sealed_ranges::RemoveSegment(address_);
}

uint64_t WritableSegment::populated_pages() const {
  MutexLock lock(&mu_);
  return populated_count_;
}

absl::StatusOr<char*> WritableSegment::Prepare(uint64_t offset, uint64_t length, bool populate) {
  if (offset > size_ || length > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat(label_, ": buffer [", offset, ", +", length,
                                                   ") outside its ", size_, " bytes"));
  }
  MutexLock lock(&mu_);
  // A sealed buffer that overlaps this one was freed (its views held its lease until they
  // went): writable again, all of it.
  auto it = sealed_.upper_bound(offset);
  if (it != sealed_.begin()) --it;
  while (it != sealed_.end() && it->first < offset + length) {
    if (it->first + it->second <= offset) {
      ++it;
      continue;
    }
    if (mprotect(address_ + it->first, it->second, PROT_READ | PROT_WRITE) != 0) {
      return ErrnoError("mprotect(PROT_WRITE)", label_, errno);
    }
    it = sealed_.erase(it);
  }
  if (populate) PopulateLocked(offset, length);
  return address_ + offset;
}

void WritableSegment::Populate(uint64_t offset, uint64_t length) {
  MutexLock lock(&mu_);
  PopulateLocked(offset, length);
}

void WritableSegment::PopulateLocked(uint64_t offset, uint64_t length) {
  const uint64_t page = PageBytes();
  // The runs of pages not populated yet: one call each instead of a fault a page.
  const uint64_t first = offset / page;
  const uint64_t last = (offset + length + page - 1) / page;
  for (uint64_t p = first; p < last && can_populate_;) {
    if (populated_[p]) {
      ++p;
      continue;
    }
    uint64_t end = p;
    while (end < last && !populated_[end]) ++end;
    if (madvise(address_ + p * page, (end - p) * page, MADV_POPULATE_WRITE) != 0) {
      can_populate_ = false;  // an old kernel (EINVAL): pages fault in as they are written
      break;
    }
    for (uint64_t q = p; q < end; ++q) populated_[q] = true;
    populated_count_ += end - p;
    p = end;
  }
}

absl::Status WritableSegment::Seal(uint64_t offset, uint64_t length) {
  if (offset > size_ || length > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat(label_, ": buffer [", offset, ", +", length,
                                                   ") outside its ", size_, " bytes"));
  }
  MutexLock lock(&mu_);
  if (mprotect(address_ + offset, length, PROT_READ) != 0) {
    return ErrnoError("mprotect(PROT_READ)", label_, errno);
  }
  sealed_[offset] = length;
  return absl::OkStatus();
}

size_t SegmentMap::size() const {
  MutexLock lock(&mu_);
  return mappings_.size();
}

absl::StatusOr<std::shared_ptr<const SegmentMapping>> SegmentMap::Find(const SegmentKey& key,
                                                                       uint64_t size) const {
  MutexLock lock(&mu_);
  auto it = mappings_.find(key);
  if (it == mappings_.end()) return nullptr;
  if (it->second->size() < size) {
    return absl::FailedPreconditionError(absl::StrCat(
        SegmentLabel(key), ": mapped with ", it->second->size(), " bytes, daemon says ", size));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<const SegmentMapping>> SegmentMap::Insert(const SegmentKey& key,
                                                                         UniqueFd fd, uint64_t size,
                                                                         std::string shm_name,
                                                                         uint64_t offset,
                                                                         uint64_t length) {
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoError("fstat", SegmentLabel(key), errno);
  if (static_cast<uint64_t>(st.st_size) < size) {
    return absl::FailedPreconditionError(
        absl::StrCat(SegmentLabel(key), ": ", st.st_size, " bytes, daemon says ", size));
  }
  Mapping mapped(mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0), size);
  const int err = errno;
  fd.reset();  // the mapping keeps the object
  if (!mapped.valid()) return ErrnoError("mmap", SegmentLabel(key), err);
  auto mapping =
      std::make_shared<const SegmentMapping>(std::move(mapped), key, std::move(shm_name));
  std::shared_ptr<const SegmentMapping> cached;
  {
    MutexLock lock(&mu_);
    cached = mappings_.emplace(key, mapping).first->second;
  }
  if (cached != mapping) return cached;  // another thread cached one first (ours is unmapped)
  // Populated, so that no read of a tensor in it faults later (the daemon reserved every page at
  // the segment's creation: this allocates nothing). Failures only leave pages to fault in.
  const uint64_t page = PageBytes();
  const uint64_t first = std::min(offset / page * page, size);
  const uint64_t end = std::min((offset + length + page - 1) / page * page, size);
  if (end > first) {
    madvise(const_cast<char*>(mapping->address()) + first, end - first, MADV_POPULATE_READ);
  }
  return mapping;
}

std::shared_ptr<WritableSegment> SegmentMap::FindWritable(const SegmentKey& key) const {
  MutexLock lock(&mu_);
  auto it = writable_.find(key);
  return it == writable_.end() ? nullptr : it->second;
}

absl::StatusOr<std::shared_ptr<WritableSegment>> SegmentMap::InsertWritable(const SegmentKey& key,
                                                                            UniqueFd fd,
                                                                            uint64_t size,
                                                                            std::string shm_name) {
  Mapping mapped(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0), size);
  if (!mapped.valid()) return ErrnoError("mmap(PROT_WRITE)", SegmentLabel(key), errno);
  auto mapping =
      std::make_shared<WritableSegment>(std::move(mapped), key, std::move(shm_name), std::move(fd));
  MutexLock lock(&mu_);
  auto [it, inserted] = writable_.emplace(key, std::move(mapping));
  return it->second;  // ours, or the one another thread cached first (ours is unmapped)
}

bool SegmentMap::Holds(const SegmentKey& key) const {
  MutexLock lock(&mu_);
  return mappings_.count(key) > 0 || writable_.count(key) > 0;
}

int SegmentMap::Retain(const std::set<SegmentKey>& live) {
  MutexLock lock(&mu_);
  int dropped = 0;
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    if (live.count(it->first) > 0) {
      ++it;
      continue;
    }
    it = mappings_.erase(it);
    ++dropped;
  }
  for (auto it = writable_.begin(); it != writable_.end();) {
    if (live.count(it->first) > 0) {
      ++it;
      continue;
    }
    it = writable_.erase(it);
  }
  return dropped;
}

}  // namespace tensorshm
