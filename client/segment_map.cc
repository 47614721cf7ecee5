#include "client/segment_map.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/sys_error.h"

namespace tensorshm {

std::string SegmentLabel(const SegmentKey& key) {
  return absl::StrFormat("segment %d (instance %016x)", key.second, key.first);
}

SegmentMapping::~SegmentMapping() { munmap(const_cast<char*>(address_), size_); }

SegmentMap::~SegmentMap() {
  MutexLock lock(&mu_);
  for (const auto& [key, fd] : writable_) close(fd);
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
                                                                         int fd, uint64_t size) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoError("fstat", SegmentLabel(key), err);
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat(SegmentLabel(key), ": ", st.st_size, " bytes, daemon says ", size));
  }
  void* address = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (address == MAP_FAILED) return ErrnoError("mmap", SegmentLabel(key), err);
  auto mapping = std::make_shared<const SegmentMapping>(static_cast<const char*>(address), size);
  MutexLock lock(&mu_);
  auto [it, inserted] = mappings_.emplace(key, mapping);
  return it->second;  // ours, or the one another thread cached first (ours is unmapped)
}

absl::StatusOr<void*> SegmentMap::MapWritableRange(const SegmentKey& key, uint64_t offset,
                                                   uint64_t length) const {
  // Under the lock: Retain must not close the descriptor between the look-up and the mmap.
  MutexLock lock(&mu_);
  auto it = writable_.find(key);
  if (it == writable_.end()) {
    return absl::NotFoundError(absl::StrCat(SegmentLabel(key), ": no writable descriptor"));
  }
  void* address = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, it->second,
                       static_cast<off_t>(offset));
  if (address == MAP_FAILED) return ErrnoError("mmap", SegmentLabel(key), errno);
  return address;
}

void SegmentMap::InsertWritable(const SegmentKey& key, int fd) {
  MutexLock lock(&mu_);
  if (!writable_.emplace(key, fd).second) close(fd);
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
    close(it->second);
    it = writable_.erase(it);
  }
  return dropped;
}

}  // namespace tensorshm
