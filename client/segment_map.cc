#include "client/segment_map.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/sys_error.h"

namespace tensorshm {

absl::Status ValidateShmName(const std::string& shm_name) {
  if (shm_name.size() < 2 || shm_name[0] != '/' || shm_name.find('/', 1) != std::string::npos ||
      shm_name.size() > 255) {
    return absl::InvalidArgumentError(absl::StrCat(
        "location.host.shm_name = \"", absl::CHexEscape(shm_name), "\": not a shm object name"));
  }
  return absl::OkStatus();
}

SegmentMap::~SegmentMap() {
  MutexLock lock(&mu_);
  for (auto& [name, mapping] : mappings_) munmap(mapping.address, mapping.size);
}

size_t SegmentMap::size() const {
  MutexLock lock(&mu_);
  return mappings_.size();
}

absl::StatusOr<const char*> SegmentMap::MapReadOnly(const std::string& shm_name, uint64_t size) {
  MutexLock lock(&mu_);
  if (auto it = mappings_.find(shm_name); it != mappings_.end()) {
    if (it->second.size < size) {
      return absl::FailedPreconditionError(absl::StrCat(
          "segment ", shm_name, ": mapped with ", it->second.size, " bytes, daemon says ", size));
    }
    return static_cast<const char*>(it->second.address);
  }
  if (absl::Status s = ValidateShmName(shm_name); !s.ok()) return s;
  const int fd = shm_open(shm_name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoError("shm_open", shm_name, errno);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoError("fstat", shm_name, err);
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("segment ", shm_name, ": ", st.st_size, " bytes, daemon says ", size));
  }
  void* address = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (address == MAP_FAILED) return ErrnoError("mmap", shm_name, err);
  mappings_.emplace(shm_name, Mapping{address, size});
  return static_cast<const char*>(address);
}

absl::StatusOr<void*> MapWritable(const std::string& shm_name, uint64_t offset, uint64_t length) {
  if (absl::Status s = ValidateShmName(shm_name); !s.ok()) return s;
  const int fd = shm_open(shm_name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoError("shm_open", shm_name, errno);
  void* address =
      mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
  const int err = errno;
  close(fd);
  if (address == MAP_FAILED) return ErrnoError("mmap", shm_name, err);
  return address;
}

}  // namespace tensorshm
