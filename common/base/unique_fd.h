// UniqueFd: the one owner of a file descriptor. Whoever holds it closes it (when it goes, or on
// reset); handing it on is a move, and handing the number to something that closes it itself
// (gRPC, a C API) is release(). A descriptor passed around as a bare int is borrowed, never owned.
#ifndef TENSORSHM_COMMON_BASE_UNIQUE_FD_H_
#define TENSORSHM_COMMON_BASE_UNIQUE_FD_H_

#include <unistd.h>

#include <utility>

namespace tensorshm {

class UniqueFd {
 public:
  UniqueFd() = default;
  // Takes `fd` (-1: none).
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }

  // The descriptor, no longer owned here: the caller closes it (or hands it to what will).
  [[nodiscard]] int release() { return std::exchange(fd_, -1); }
  // Closes what is held, then holds `fd`. A failed close is not reported: POSIX leaves the
  // descriptor closed either way, and there is nothing to retry.
  void reset(int fd = -1) {
    const int old = std::exchange(fd_, fd);
    if (old >= 0) ::close(old);
  }

 private:
  int fd_ = -1;
};

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_BASE_UNIQUE_FD_H_
