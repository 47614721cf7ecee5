// A shared memory object created by tensorshmd: one host pool segment, or the control segment.
// Either a named POSIX shm object in /dev/shm (survives the daemon, so a restarted daemon can
// recover it) or an anonymous memfd (not bound by the size of /dev/shm; dies with the daemon).
// Move-only; the creator unlinks a named object when destroyed.
#ifndef TENSORSHM_SERVER_MEMORY_SHM_SEGMENT_H_
#define TENSORSHM_SERVER_MEMORY_SHM_SEGMENT_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/mapping.h"
#include "common/base/unique_fd.h"

namespace tensorshm {

// The mode of every object tensorshmd creates, host segments given to a --shm-group aside
// (kGroupSegmentMode, 0660); a restarted daemon takes back only objects of this mode, or of that
// one with that group, owned by its uid.
inline constexpr mode_t kSegmentMode = 0600;
// The mode of a host pool segment given to a --shm-group (server/ops/shm_group.h).
inline constexpr mode_t kGroupSegmentMode = 0660;

enum class SegmentBacking {
  kNamed,  // POSIX shm object "/<name>" in /dev/shm
  kMemfd,  // memfd_create: anonymous, sealed against resizing
};

// Thread-compatible.
class ShmSegment {
 public:
  // Creates the object `name` ("/..."; a memfd takes it as its debugging name), `size` bytes,
  // mode 0600 regardless of the umask (with `group`: mode 0660 and that group, for --shm-group),
  // and reserves all its pages with posix_fallocate so that a full /dev/shm (or memory cgroup)
  // fails here rather than later as SIGBUS in a client. With `map` the daemon also maps it
  // read-write. Returns ALREADY_EXISTS if the name is taken, RESOURCE_EXHAUSTED if `size` bytes
  // cannot be reserved, PERMISSION_DENIED if the object cannot be given to `group`, or another
  // error naming the call and object; on error a created object is removed again.
  static absl::StatusOr<ShmSegment> Create(const std::string& name, uint64_t size, bool map,
                                           SegmentBacking backing = SegmentBacking::kNamed,
                                           std::optional<gid_t> group = std::nullopt);

  // Re-opens the existing named object `name` (a restarted daemon taking its segments back); the
  // result owns it like a created one. Its size is the object's. NOT_FOUND if it is gone.
  // Only an object this daemon could have created is taken: opened without following a link
  // (O_NOFOLLOW), it must be a regular file owned by the daemon's euid with mode kSegmentMode, or,
  // with `group`, mode kGroupSegmentMode and that group; it is then given the current setting
  // (with `group`: 0660 and that group). Anything else is FAILED_PRECONDITION naming the object,
  // its owner, group and mode and the fix, and is left in place (never unlinked): without
  // `group` an object of mode 0660 is refused too, as the members of its group could have
  // written it.
  static absl::StatusOr<ShmSegment> Open(const std::string& name, bool map,
                                         std::optional<gid_t> group = std::nullopt);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();  // unmaps, closes, and unlinks a named object

  // Leaves a named object in place when this is destroyed (--keep-segments).
  void Keep() { keep_ = true; }

  // Removes a named object's name now (the object lives on until its last descriptor and
  // mapping go), so that the name is free for a new object at once; destroying this then
  // unlinks nothing. Nothing for a memfd or a kept object.
  void Unlink();

  // Frees every page of the object (punches it out; the size stays), whoever maps it: a segment
  // given back to the pool keeps no memory for clients that still map it. Errors name the call
  // and the object.
  absl::Status Discard() { return Discard(0, size_); }
  // Frees the pages of [offset, offset + length) alone, the same way.
  absl::Status Discard(uint64_t offset, uint64_t length);

  // A new descriptor of the object for a client (close-on-exec; the memory channel sends it):
  // read-only, or read-write. A read-only one cannot be mapped writable nor reopened writable by
  // anyone but the daemon's uid (the object is mode 0600), and the members of a --shm-group
  // (mode 0660), who can open the object by name anyway.
  // Errors name the call and the object.
  absl::StatusOr<UniqueFd> OpenForClient(bool writable) const;

  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }
  SegmentBacking backing() const { return backing_; }
  // The daemon's read-write mapping; nullptr unless created with `map`.
  void* address() const { return mapping_.data(); }

 private:
  ShmSegment(std::string name, uint64_t size, UniqueFd fd, SegmentBacking backing)
      : name_(std::move(name)), size_(size), fd_(std::move(fd)), backing_(backing) {}
  void Reset();

  std::string name_;
  uint64_t size_ = 0;
  UniqueFd fd_;  // read-write, kept for OpenForClient
  Mapping mapping_;
  SegmentBacking backing_ = SegmentBacking::kNamed;
  bool keep_ = false;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_MEMORY_SHM_SEGMENT_H_
