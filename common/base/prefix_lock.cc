#include "common/base/prefix_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/base/sys_error.h"

namespace tensorshm {
namespace {

constexpr mode_t kLockMode = 0600;
// A lock file is a few lines; more is not one of ours, and is not read past this.
constexpr size_t kMaxLockFileBytes = 4096;

PrefixHolder ParseHolder(const std::string& text) {
  PrefixHolder holder;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const size_t space = line.find(' ');
    if (space == absl::string_view::npos) continue;
    const absl::string_view key = line.substr(0, space);
    const std::string value(line.substr(space + 1));
    if (int64_t pid; key == "pid" && absl::SimpleAtoi(value, &pid)) {
      holder.pid = pid;
    } else if (key == "host") {
      holder.host = value;
    } else if (key == "socket") {
      holder.socket = value;
    } else if (key == "state") {
      holder.state = value;
    }
  }
  return holder;
}

std::string ReadAll(int fd) {
  std::string text(kMaxLockFileBytes, '\0');
  const ssize_t got = pread(fd, text.data(), text.size(), 0);
  text.resize(got > 0 ? static_cast<size_t>(got) : 0);
  return text;
}

}  // namespace

std::string PrefixLockPath(const std::string& prefix) {
  return absl::StrCat("/dev/shm/", prefix, ".lock");
}

absl::StatusOr<PrefixHolder> ReadPrefixHolder(const std::string& prefix) {
  const std::string path = PrefixLockPath(prefix);
  const UniqueFd fd(open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) return ErrnoError("open", path, errno);
  return ParseHolder(ReadAll(fd.get()));
}

std::string DescribeHolder(const PrefixHolder& holder) {
  std::string text = "tensorshmd";
  absl::StrAppend(&text, holder.pid ? absl::StrCat(" pid ", *holder.pid) : " (pid not recorded)");
  if (!holder.host.empty()) absl::StrAppend(&text, " on host ", holder.host);
  if (!holder.socket.empty()) absl::StrAppend(&text, " (socket ", holder.socket, ")");
  return text;
}

absl::StatusOr<PrefixLock> PrefixLock::Take(const std::string& prefix, bool create,
                                            std::optional<uid_t> owner) {
  const std::string path = PrefixLockPath(prefix);
  // A holder that releases removes the file while it still holds the lock: a lock taken on a
  // file no longer under the path is no lock on the prefix, and the path is opened again.
  for (int attempt = 0;; ++attempt) {
    UniqueFd file(
        open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC | (create ? O_CREAT : 0), kLockMode));
    if (!file.valid()) {
      const int err = errno;
      struct stat st;
      if ((err == ELOOP || err == EACCES) && lstat(path.c_str(), &st) == 0) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s: %s, owned by uid %u with mode %04o: not a lock file tensorshmd made; remove it "
            "if it is stale, or choose another --shm-prefix",
            path, err == ELOOP ? "a symbolic link" : "not writable by this user", st.st_uid,
            st.st_mode & 07777));
      }
      return ErrnoError("open", path, err);
    }
    const int fd = file.get();
    PrefixLock lock(path, std::move(file));
    lock.keep_ = true;  // not ours to remove until it is locked and checked
    struct stat opened;
    if (fstat(fd, &opened) != 0) return ErrnoError("fstat", path, errno);
    if (!S_ISREG(opened.st_mode) ||
        (owner && (opened.st_uid != *owner || (opened.st_mode & 07777) != kLockMode))) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: %s, owned by uid %u with mode %04o; tensorshmd makes its lock files as regular "
          "files owned by its uid (%u) with mode %04o: remove it if it is stale, or choose "
          "another --shm-prefix",
          path, S_ISREG(opened.st_mode) ? "another user's file or mode" : "not a regular file",
          opened.st_uid, opened.st_mode & 07777, owner.value_or(opened.st_uid), kLockMode));
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EWOULDBLOCK) {
        return absl::UnavailableError(absl::StrCat(path, ": locked by another process"));
      }
      return ErrnoError("flock", path, err);
    }
    struct stat named;
    if (lstat(path.c_str(), &named) != 0 || named.st_dev != opened.st_dev ||
        named.st_ino != opened.st_ino) {
      if (attempt < 100) continue;  // `lock` closes the stale file
      return absl::UnavailableError(absl::StrCat(path, ": replaced while being locked"));
    }
    lock.keep_ = false;
    lock.previous_ = ParseHolder(ReadAll(fd));
    return lock;
  }
}

PrefixLock::PrefixLock(PrefixLock&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::move(other.fd_)),
      keep_(other.keep_),
      previous_(std::move(other.previous_)) {
  other.path_.clear();
}

PrefixLock& PrefixLock::operator=(PrefixLock&& other) noexcept {
  if (this != &other) {
    Reset();
    path_ = std::move(other.path_);
    fd_ = std::move(other.fd_);
    keep_ = other.keep_;
    previous_ = std::move(other.previous_);
    other.path_.clear();
  }
  return *this;
}

PrefixLock::~PrefixLock() { Reset(); }

void PrefixLock::Reset() {
  if (!fd_.valid()) return;
  // Removed while still locked: a process waiting on this file finds it gone from the path
  // (Take checks) rather than locking a file nobody else will see.
  if (!keep_) unlink(path_.c_str());
  fd_.reset();
}

absl::Status PrefixLock::Record(const PrefixHolder& holder) {
  std::string text;
  if (holder.pid) absl::StrAppend(&text, "pid ", *holder.pid, "\n");
  if (!holder.host.empty()) absl::StrAppend(&text, "host ", holder.host, "\n");
  if (!holder.socket.empty()) absl::StrAppend(&text, "socket ", holder.socket, "\n");
  if (!holder.state.empty()) absl::StrAppend(&text, "state ", holder.state, "\n");
  if (ftruncate(fd_.get(), 0) != 0) return ErrnoError("ftruncate", path_, errno);
  if (pwrite(fd_.get(), text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    return ErrnoError("pwrite", path_, errno);
  }
  return absl::OkStatus();
}

}  // namespace tensorshm
