// A POSIX shared memory object created by tensorshmd: one host pool segment, or the control
// segment. Move-only; the creator unlinks it when destroyed.
#ifndef TENSORSHM_SERVER_SHM_SEGMENT_H_
#define TENSORSHM_SERVER_SHM_SEGMENT_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tensorshm {

// Thread-compatible.
class ShmSegment {
 public:
  // Creates the shm object `name` ("/..."), `size` bytes, with `mode` permissions regardless of
  // the umask, and reserves all its pages with posix_fallocate so that a full /dev/shm fails
  // here rather than later as SIGBUS in a client. With `map` the daemon also maps it read-write.
  // Returns ALREADY_EXISTS if the name is taken, RESOURCE_EXHAUSTED if /dev/shm cannot hold
  // `size` bytes (the object is removed again), or another error naming the call and object.
  // `group`, unless (gid_t)-1, becomes the object's group (for --allow-gid).
  static absl::StatusOr<ShmSegment> Create(const std::string& name, uint64_t size, mode_t mode,
                                           bool map, gid_t group = static_cast<gid_t>(-1));

  // Re-opens the existing shm object `name` (a restarted daemon taking its segments back); the
  // result owns it like a created one. Its size is the object's. NOT_FOUND if it is gone.
  static absl::StatusOr<ShmSegment> Open(const std::string& name, bool map);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();  // unmaps and unlinks

  // Leaves the shm object in place when this is destroyed (--keep-segments).
  void Keep() { keep_ = true; }

  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }
  // The daemon's read-write mapping; nullptr unless created with `map`.
  void* address() const { return address_; }

 private:
  ShmSegment(std::string name, uint64_t size, void* address)
      : name_(std::move(name)), size_(size), address_(address) {}
  void Reset();

  std::string name_;
  uint64_t size_ = 0;
  void* address_ = nullptr;
  bool keep_ = false;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_SHM_SEGMENT_H_
