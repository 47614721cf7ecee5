#include "server/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/permissions.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/sys_error.h"

namespace tensorshm {
namespace bip = boost::interprocess;

absl::StatusOr<ShmSegment> ShmSegment::Create(const std::string& name, uint64_t size, mode_t mode,
                                              bool map, gid_t group) {
  if (name.size() < 2 || name[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("shm name = \"", name, "\": must start with /"));
  }
  bip::shared_memory_object object;
  try {
    // Boost.Interprocess creates with exactly `mode` (it applies fchmod after creation, so the
    // umask does not widen or narrow it).
    object = bip::shared_memory_object(bip::create_only, name.c_str() + 1, bip::read_write,
                                       bip::permissions(mode));
  } catch (const bip::interprocess_exception& e) {
    return ErrnoError("shm_open", name, e.get_native_error());
  }
  // From here on the object exists; remove it again on any failure.
  auto fail = [&](absl::Status status) {
    bip::shared_memory_object::remove(name.c_str() + 1);
    return status;
  };
  const int fd = object.get_mapping_handle().handle;
  if (group != static_cast<gid_t>(-1) && fchown(fd, static_cast<uid_t>(-1), group) != 0) {
    return fail(ErrnoError("fchown", name, errno));
  }
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
    if (err == ENOSPC) {
      return fail(absl::ResourceExhaustedError(absl::StrCat(
          "posix_fallocate(", name, ", ", size,
          " bytes): /dev/shm has no room for the segment; enlarge /dev/shm (docker --shm-size, "
          "Kubernetes emptyDir medium Memory sizeLimit) or lower --host-pool")));
    }
    return fail(ErrnoError("posix_fallocate", name, err));
  }
  void* address = nullptr;
  if (map) {
    address = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (address == MAP_FAILED) return fail(ErrnoError("mmap", name, errno));
  }
  // `object` closes its descriptor here; the mapping and the name stay.
  return ShmSegment(name, size, address);
}

absl::StatusOr<ShmSegment> ShmSegment::Open(const std::string& name, bool map) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoError("shm_open", name, errno);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoError("fstat", name, err);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  void* address = nullptr;
  if (map) {
    address = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (address == MAP_FAILED) {
      const int err = errno;
      close(fd);
      return ErrnoError("mmap", name, err);
    }
  }
  close(fd);
  return ShmSegment(name, size, address);
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)),
      size_(other.size_),
      address_(other.address_),
      keep_(other.keep_) {
  other.name_.clear();
  other.address_ = nullptr;
}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    size_ = other.size_;
    address_ = other.address_;
    keep_ = other.keep_;
    other.name_.clear();
    other.address_ = nullptr;
  }
  return *this;
}

ShmSegment::~ShmSegment() { Reset(); }

void ShmSegment::Reset() {
  if (address_ != nullptr) munmap(address_, size_);
  address_ = nullptr;
  if (!name_.empty() && !keep_) bip::shared_memory_object::remove(name_.c_str() + 1);
  name_.clear();
}

}  // namespace tensorshm
