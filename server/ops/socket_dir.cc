#include "server/ops/socket_dir.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/base/sys_error.h"
#include "common/base/unique_fd.h"
#include "server/ops/log.h"

namespace tensorshm {
namespace {

std::string Mode(mode_t mode) { return absl::StrFormat("%04o", mode & 07777); }

bool WritableByOthers(mode_t mode) { return (mode & (S_IWGRP | S_IWOTH)) != 0; }
bool Sticky(mode_t mode) { return (mode & S_ISVTX) != 0; }

absl::Status Refuse(const std::string& socket, absl::string_view detail) {
  return absl::FailedPreconditionError(absl::StrCat("--socket = \"", socket, "\": ", detail));
}

// `shown` + "/" + `part`, as a reader expects it.
std::string Join(const std::string& shown, const std::string& part) {
  if (shown == "/") return "/" + part;
  if (shown == ".") return part;
  return absl::StrCat(shown, "/", part);
}

// Refuses `name` in `dir` (shown as `shown`), which open(O_NOFOLLOW) did not take as a
// directory: a symbolic link is named with its target and owner.
absl::Status RefuseNonDirectory(int dir, const std::string& name, const std::string& shown,
                                const std::string& socket) {
  struct stat st;
  if (fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
    char target[PATH_MAX] = {};
    const ssize_t length = readlinkat(dir, name.c_str(), target, sizeof(target) - 1);
    return Refuse(
        socket,
        absl::StrCat(shown, " is a symbolic link (to ", length >= 0 ? target : "?",
                     ", owned by uid ", st.st_uid,
                     "); tensorshmd follows no link in the socket's path, so that a link another "
                     "user planted cannot redirect it: give --socket the path without links, or "
                     "remove the link if nobody should have made it"));
  }
  return Refuse(socket, absl::StrCat(shown, " is not a directory"));
}

// The directory `name` in `dir`, opened without following a link (O_PATH: search permission is
// enough). NOT_FOUND if there is none.
absl::StatusOr<UniqueFd> OpenDirectory(int dir, const std::string& name, const std::string& shown,
                                       const std::string& socket) {
  UniqueFd fd(openat(dir, name.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.valid()) return fd;
  const int err = errno;
  if (err == ENOTDIR || err == ELOOP) return RefuseNonDirectory(dir, name, shown, socket);
  return ErrnoError("open", shown, err);
}

// Creates directory `name` in `dir`: 0700 (the umask is 077), or 0711 when `shared`. False if
// another process made it first.
absl::StatusOr<bool> MakeDirectory(int dir, const std::string& name, const std::string& shown,
                                   bool shared) {
  if (mkdirat(dir, name.c_str(), 0700) != 0) {
    if (errno == EEXIST) return false;
    return ErrnoError("mkdir", shown, errno);
  }
  if (shared) {
    // Others must reach a shared socket: they can traverse the directory, not list it.
    const UniqueFd made(openat(dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!made.valid()) return ErrnoError("open", shown, errno);
    if (fchmod(made.get(), 0711) != 0) return ErrnoError("chmod", shown, errno);
  }
  return true;
}

// The rule for a directory above the socket's own (see the header).
absl::Status CheckAncestor(const struct stat& st, const std::string& shown,
                           const std::string& socket, uid_t euid) {
  if ((st.st_uid == 0 || st.st_uid == euid) &&
      (!WritableByOthers(st.st_mode) || Sticky(st.st_mode))) {
    return absl::OkStatus();
  }
  return Refuse(
      socket,
      absl::StrCat(shown, " (a directory above the socket's) is owned by uid ", st.st_uid,
                   " with mode ", Mode(st.st_mode),
                   ": another user could replace the socket's directory in it. "
                   "tensorshmd (uid ",
                   euid, ") needs every directory above the socket owned by root or uid ", euid,
                   " and not writable by group or others (or sticky, as /tmp): fix its "
                   "owner or mode (chmod go-w ",
                   shown, "), or choose another --socket"));
}

// The rule for the socket's own directory (see the header).
absl::Status CheckSocketDirectory(const struct stat& st, const std::string& shown,
                                  const std::string& socket, uid_t euid) {
  if (st.st_uid == euid && !WritableByOthers(st.st_mode)) return absl::OkStatus();
  if (st.st_uid == 0 && Sticky(st.st_mode)) return absl::OkStatus();  // /tmp itself
  const std::string what = absl::StrCat("the socket's directory ", shown, " is owned by uid ",
                                        st.st_uid, " with mode ", Mode(st.st_mode));
  if (st.st_uid != euid) {
    return Refuse(
        socket,
        absl::StrCat(what, ", not by tensorshmd's uid ", euid,
                     ": another user may have made it to take over the socket. Remove ", shown,
                     " (its owner or root can) and start tensorshmd again to have it made afresh, "
                     "or choose another --socket in a directory uid ",
                     euid, " owns that is not writable by group or others"));
  }
  return Refuse(socket,
                absl::StrCat(what,
                             ": writable by group or others, who could replace the socket. "
                             "Run chmod go-w ",
                             shown,
                             " (or remove it and let tensorshmd make it), or choose another "
                             "--socket"));
}

}  // namespace

absl::Status PrepareSocketPath(const std::string& path, bool shared, uid_t euid) {
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--socket = \"", path, "\": longer than ",
                                                   sizeof(address.sun_path) - 1, " bytes"));
  }
  const size_t slash = path.rfind('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (name.empty() || name == "." || name == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket = \"", path, "\": names a directory, not the socket's file"));
  }
  const bool absolute = path[0] == '/';
  std::vector<std::string> parts;
  if (slash != std::string::npos) {
    parts = absl::StrSplit(path.substr(0, slash), '/', absl::SkipEmpty());
  }
  std::string shown = absolute ? "/" : ".";
  UniqueFd dir(open(shown.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir.valid()) return ErrnoError("open", shown, errno);
  // Walk down one directory at a time, each opened from its checked parent without following
  // links, so that what is checked is what the socket will be bound in.
  for (size_t i = 0;; ++i) {
    struct stat st;
    if (fstat(dir.get(), &st) != 0) return ErrnoError("fstat", shown, errno);
    if (i == parts.size()) {
      if (absl::Status s = CheckSocketDirectory(st, shown, path, euid); !s.ok()) return s;
      break;
    }
    if (absl::Status s = CheckAncestor(st, shown, path, euid); !s.ok()) return s;
    const std::string next = Join(shown, parts[i]);
    absl::StatusOr<UniqueFd> opened = OpenDirectory(dir.get(), parts[i], next, path);
    if (absl::IsNotFound(opened.status())) {
      absl::StatusOr<bool> made = MakeDirectory(dir.get(), parts[i], next, shared);
      if (!made.ok()) return made.status();
      opened = OpenDirectory(dir.get(), parts[i], next, path);
    }
    if (!opened.ok()) return opened.status();
    dir = *std::move(opened);
    shown = next;
  }

  struct stat st;
  if (fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return errno == ENOENT ? absl::OkStatus() : ErrnoError("lstat", path, errno);
  }
  if (S_ISLNK(st.st_mode)) return RefuseNonDirectory(dir.get(), name, path, path);
  if (!S_ISSOCK(st.st_mode)) {
    return Refuse(path, "exists and is not a socket: remove it or choose another --socket");
  }
  if (st.st_uid != euid) {
    return Refuse(path, absl::StrCat("a socket owned by uid ", st.st_uid, " with mode ",
                                     Mode(st.st_mode), " is there, not tensorshmd's (uid ", euid,
                                     "): remove it (its owner or root can) or choose another "
                                     "--socket"));
  }
  UniqueFd probe(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!probe.valid()) return ErrnoError("socket", path, errno);
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  const bool live =
      connect(probe.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  probe.reset();
  if (live) return Refuse(path, "another tensorshmd is serving there");
  if (unlinkat(dir.get(), name.c_str(), 0) != 0) return ErrnoError("unlink", path, errno);
  TSM_LOG(kInfo) << "removed stale socket " << path;
  return absl::OkStatus();
}

}  // namespace tensorshm
