#include "server/memory/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/permissions.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/sys_error.h"
#include "server/ops/shm_group.h"

namespace tensorshm {
namespace bip = boost::interprocess;

namespace {

// Reserves every page of `fd` (see Create); RESOURCE_EXHAUSTED when there is no room.
absl::Status Reserve(int fd, const std::string& name, uint64_t offset, uint64_t length,
                     SegmentBacking backing) {
  const int err = posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(length));
  if (err == 0) return absl::OkStatus();
  if (err == ENOSPC || err == ENOMEM) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "posix_fallocate(", name, ", ", length, " bytes): ",
        backing == SegmentBacking::kMemfd
            ? "out of memory for the segment (memory cgroup or RAM); lower --host-pool"
            : "/dev/shm has no room for the segment; enlarge /dev/shm (docker --shm-size, "
              "Kubernetes emptyDir medium Memory sizeLimit), use --segments memfd, or lower "
              "--host-pool"));
  }
  return ErrnoError("posix_fallocate", name, err);
}

// Gives the object behind `fd` to `group` with mode 0660, whatever the umask: the group first, so
// that the object is never 0660 with another group. PERMISSION_DENIED naming the object, the
// group and the fix if the daemon may not.
absl::Status GiveToGroup(int fd, const std::string& name, gid_t group) {
  if (fchown(fd, static_cast<uid_t>(-1), group) != 0) {
    const int err = errno;
    const std::string what =
        absl::StrCat(name, " to group ", GroupName(group), " (gid ", group, ", --shm-group)");
    if (err != EPERM && err != EINVAL) return ErrnoError("fchown", what, err);
    // EINVAL: a gid that the daemon's user namespace does not map.
    return absl::PermissionDeniedError(absl::StrCat(
        "fchown(", what, "): ", std::strerror(err),
        ": tensorshmd must run as root (CAP_CHOWN, with the gid mapped in its user namespace) or "
        "as a member of the group"));
  }
  if (fchmod(fd, kGroupSegmentMode) != 0) return ErrnoError("fchmod", name, errno);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ShmSegment> ShmSegment::Create(const std::string& name, uint64_t size, bool map,
                                              SegmentBacking backing, std::optional<gid_t> group) {
  if (name.size() < 2 || name[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("shm name = \"", name, "\": must start with /"));
  }
  UniqueFd fd;
  if (backing == SegmentBacking::kMemfd) {
    // Sealed against resizing below: a client holding a writable descriptor cannot shrink the
    // object under other processes' mappings (which would turn their reads into SIGBUS).
    fd.reset(memfd_create(name.c_str() + 1, MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fd.valid()) return ErrnoError("memfd_create", name, errno);
    // A memfd starts as 0777: reopening a read-only descriptor through /proc must not give
    // another uid write access.
    if (fchmod(fd.get(), kSegmentMode) != 0) return ErrnoError("fchmod", name, errno);
  } else {
    bip::shared_memory_object object;
    try {
      // Boost.Interprocess creates with exactly `mode` (it applies fchmod after creation, so the
      // umask does not widen or narrow it).
      object = bip::shared_memory_object(bip::create_only, name.c_str() + 1, bip::read_write,
                                         bip::permissions(kSegmentMode));
    } catch (const bip::interprocess_exception& e) {
      return ErrnoError("shm_open", name, e.get_native_error());
    }
    // `object` closes its descriptor when it goes; the segment keeps one of its own.
    fd.reset(fcntl(object.get_mapping_handle().handle, F_DUPFD_CLOEXEC, 0));
    if (!fd.valid()) {
      const int err = errno;
      bip::shared_memory_object::remove(name.c_str() + 1);
      return ErrnoError("fcntl(F_DUPFD_CLOEXEC)", name, err);
    }
  }
  // From here on `segment` owns the descriptor, and removes a named object on failure.
  ShmSegment segment(name, size, std::move(fd), backing);
  const int owned = segment.fd_.get();
  if (group) {
    if (absl::Status s = GiveToGroup(owned, name, *group); !s.ok()) return s;
  }
  if (absl::Status s = Reserve(owned, name, 0, size, backing); !s.ok()) return s;
  if (backing == SegmentBacking::kMemfd &&
      fcntl(owned, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return ErrnoError("fcntl(F_ADD_SEALS)", name, errno);
  }
  if (map) {
    void* address = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, owned, 0);
    if (address == MAP_FAILED) return ErrnoError("mmap", name, errno);
    segment.mapping_ = Mapping(address, size);
  }
  return segment;
}

absl::StatusOr<ShmSegment> ShmSegment::Open(const std::string& name, bool map,
                                            std::optional<gid_t> group) {
  const std::string path = absl::StrCat("/dev/shm", name);
  const uid_t euid = geteuid();
  // Refusals name the object and say what to do; the object is never removed: it is not ours.
  auto foreign = [&](const struct stat& st, absl::string_view what) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: %s, owned by uid %u with mode %04o; tensorshmd creates its shm objects as regular "
        "files owned by its uid (%u) with mode %04o%s, so this is not one of its own and is left "
        "alone: remove it (rm %s) if it is stale, or start tensorshmd with another --shm-prefix",
        path, what, st.st_uid, st.st_mode & 07777, euid, kSegmentMode,
        group ? absl::StrFormat(" (host segments %04o with group %s, --shm-group)",
                                kGroupSegmentMode, GroupName(*group))
              : "",
        path));
  };
  // Ours, but given to a group that is not --shm-group's (or to a group while there is no
  // --shm-group now): the group's members could have written it.
  auto grouped = [&](const struct stat& st) {
    const std::string its = GroupName(st.st_gid);
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: owned by uid %u with mode %04o and group %s (gid %u), as tensorshmd started with "
        "--shm-group %s makes it; any member of that group could have written it, so %s does "
        "not take it back: restart with --shm-group %s, or remove it (rm %s)",
        path, st.st_uid, st.st_mode & 07777, its, st.st_gid, its,
        group ? absl::StrCat("a tensorshmd with --shm-group ", GroupName(*group))
              : "a tensorshmd without --shm-group",
        its, path));
  };
  // O_NOFOLLOW: a link planted under the name must not lead the daemon to another file.
  UniqueFd fd(shm_open(name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0));
  if (!fd.valid()) {
    const int err = errno;
    struct stat st;
    if (err == ELOOP && lstat(path.c_str(), &st) == 0) return foreign(st, "a symbolic link");
    if (err == EACCES && stat(path.c_str(), &st) == 0) return foreign(st, "not writable by it");
    return ErrnoError("shm_open", name, err);
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoError("fstat", name, errno);
  const mode_t mode = st.st_mode & 07777;
  if (!S_ISREG(st.st_mode) || st.st_uid != euid) {
    return foreign(st, !S_ISREG(st.st_mode) ? "not a regular file" : "another user's object");
  }
  if (mode == kGroupSegmentMode && (!group || st.st_gid != *group)) return grouped(st);
  if (mode != kSegmentMode && mode != kGroupSegmentMode) {
    return foreign(st, "not of the mode tensorshmd gives its objects");
  }
  // Taken back under the current setting: a segment of a daemon without --shm-group joins the
  // group now (its bytes were the daemon uid's alone until then).
  if (group) {
    if (absl::Status s = GiveToGroup(fd.get(), name, *group); !s.ok()) return s;
  }
  ShmSegment segment(name, static_cast<uint64_t>(st.st_size), std::move(fd),
                     SegmentBacking::kNamed);
  if (map) {
    void* address =
        mmap(nullptr, segment.size_, PROT_READ | PROT_WRITE, MAP_SHARED, segment.fd_.get(), 0);
    if (address == MAP_FAILED) {
      segment.keep_ = true;  // not ours to remove on a failed open
      return ErrnoError("mmap", name, errno);
    }
    segment.mapping_ = Mapping(address, segment.size_);
  }
  return segment;
}

absl::StatusOr<UniqueFd> ShmSegment::OpenForClient(bool writable) const {
  if (writable) {
    UniqueFd fd(fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoError("fcntl(F_DUPFD_CLOEXEC)", name_, errno);
    return fd;
  }
  // A new open file description, read-only: a duplicate of fd_ would carry its write access.
  if (backing_ == SegmentBacking::kNamed) {
    UniqueFd fd(shm_open(name_.c_str(), O_RDONLY | O_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoError("shm_open(O_RDONLY)", name_, errno);
    // The name must still be this object: never hand out another under it.
    struct stat ours;
    struct stat opened;
    if (fstat(fd_.get(), &ours) != 0 || fstat(fd.get(), &opened) != 0 ||
        ours.st_dev != opened.st_dev || ours.st_ino != opened.st_ino) {
      return absl::DataLossError(
          absl::StrCat(name_,
                       ": the name belongs to another object now (removed or replaced behind the "
                       "daemon's back)"));
    }
    return fd;
  }
  // A memfd has no name to open: its /proc link is reopened instead.
  const std::string path = absl::StrCat("/proc/self/fd/", fd_.get());
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoError("open(" + path + ", O_RDONLY)", name_, errno);
  return fd;
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)),
      size_(other.size_),
      fd_(std::move(other.fd_)),
      mapping_(std::move(other.mapping_)),
      backing_(other.backing_),
      keep_(other.keep_) {
  other.name_.clear();
}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    size_ = other.size_;
    fd_ = std::move(other.fd_);
    mapping_ = std::move(other.mapping_);
    backing_ = other.backing_;
    keep_ = other.keep_;
    other.name_.clear();
  }
  return *this;
}

ShmSegment::~ShmSegment() { Reset(); }

absl::Status ShmSegment::Discard(uint64_t offset, uint64_t length) {
  if (fallocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(length)) != 0) {
    return ErrnoError("fallocate(PUNCH_HOLE)", name_, errno);
  }
  return absl::OkStatus();
}

void ShmSegment::Unlink() {
  if (keep_ || backing_ != SegmentBacking::kNamed || name_.empty()) return;
  bip::shared_memory_object::remove(name_.c_str() + 1);
  keep_ = true;  // nothing left to unlink, and never a later object under the same name
}

void ShmSegment::Reset() {
  mapping_.reset();
  fd_.reset();
  if (!name_.empty() && !keep_ && backing_ == SegmentBacking::kNamed) {
    bip::shared_memory_object::remove(name_.c_str() + 1);
  }
  name_.clear();
}

}  // namespace tensorshm
