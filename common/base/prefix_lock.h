// The lock that makes one tensorshmd the holder of an shm prefix: an exclusive flock on the
// file /dev/shm/<prefix>.lock, which also records who holds it.
//
// Why a file in /dev/shm: the prefix names objects in /dev/shm, so whoever can collide on the
// objects (two daemons with different sockets, daemons in containers sharing /dev/shm) collides
// on this file too, and flock is one lock across them all (one kernel). The kernel releases it
// when the holder dies however it dies (SIGKILL included), so a prefix whose holder is gone is
// free to recover, and a live one is never taken twice.
//
// The file's text, one "key value" per line (read by the next daemon's refusal and by
// `tensorshmctl leftovers`): pid (in the holder's own pid namespace), host (its hostname, which
// tells containers apart), socket, state ("serving", or "kept" after a stop with
// --keep-segments).
#ifndef TENSORSHM_COMMON_BASE_PREFIX_LOCK_H_
#define TENSORSHM_COMMON_BASE_PREFIX_LOCK_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/unique_fd.h"

namespace tensorshm {

// What a prefix's lock file says about its (last) holder; fields it does not state are empty.
struct PrefixHolder {
  std::optional<int64_t> pid;
  std::string host;
  std::string socket;
  std::string state;
};

// "/dev/shm/<prefix>.lock".
std::string PrefixLockPath(const std::string& prefix);

// Reads the lock file of `prefix` without locking it. NOT_FOUND if there is none.
absl::StatusOr<PrefixHolder> ReadPrefixHolder(const std::string& prefix);

// "tensorshmd pid 1234 on host h (socket /run/x.sock)", as far as `holder` says.
std::string DescribeHolder(const PrefixHolder& holder);

// Holds the lock on one prefix. Move-only; thread-compatible. Releasing it (destruction) removes
// the file first unless Keep() was called, so a prefix whose daemon stopped cleanly leaves
// nothing in /dev/shm.
class PrefixLock {
 public:
  // Opens /dev/shm/<prefix>.lock (creating it, mode 0600, with `create`) without following a
  // link and takes an exclusive flock on it without waiting. The file must be a regular file,
  // and with `owner` owned by that uid with mode 0600. Returns UNAVAILABLE if another process
  // holds the lock (the caller reads the holder with ReadPrefixHolder), NOT_FOUND without
  // `create` if there is no file, FAILED_PRECONDITION naming the file, its owner and mode for
  // a file tensorshmd did not make, other codes (named) for failed calls.
  static absl::StatusOr<PrefixLock> Take(const std::string& prefix, bool create,
                                         std::optional<uid_t> owner);

  PrefixLock(PrefixLock&& other) noexcept;
  PrefixLock& operator=(PrefixLock&& other) noexcept;
  PrefixLock(const PrefixLock&) = delete;
  PrefixLock& operator=(const PrefixLock&) = delete;
  ~PrefixLock();

  // What the file said before this lock was taken (the last holder's record).
  const PrefixHolder& previous() const { return previous_; }

  // Replaces the file's text with `holder`'s. Errors name the call and the file.
  absl::Status Record(const PrefixHolder& holder);

  // Leaves the file in place when the lock is released.
  void Keep() { keep_ = true; }

  const std::string& path() const { return path_; }

 private:
  PrefixLock(std::string path, UniqueFd fd) : path_(std::move(path)), fd_(std::move(fd)) {}
  void Reset();

  std::string path_;
  UniqueFd fd_;
  bool keep_ = false;
  PrefixHolder previous_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_BASE_PREFIX_LOCK_H_
