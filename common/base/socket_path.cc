#include "common/base/socket_path.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace tensorshm {

std::string DefaultSocketPath() {
  if (const char* path = std::getenv("TENSORSHM_SOCKET"); path != nullptr && *path != '\0') {
    return path;
  }
  if (const char* dir = std::getenv("XDG_RUNTIME_DIR"); dir != nullptr && *dir != '\0') {
    return absl::StrCat(dir, "/tensorshm.sock");
  }
  return absl::StrCat("/tmp/tensorshm-", getuid(), "/tensorshm.sock");
}

std::string DefaultSocketSource() {
  auto set = [](const char* name) {
    const char* value = std::getenv(name);
    return value != nullptr && *value != '\0';
  };
  if (set("TENSORSHM_SOCKET")) return "$TENSORSHM_SOCKET";
  if (set("XDG_RUNTIME_DIR")) return "$XDG_RUNTIME_DIR/tensorshm.sock ($TENSORSHM_SOCKET unset)";
  return "/tmp/tensorshm-$UID ($TENSORSHM_SOCKET and $XDG_RUNTIME_DIR unset)";
}

namespace {

bool IsSocket(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

// A socket at `path` that this user's own daemon made: the socket and its directory are this
// process's effective uid's, and no one else can write the directory. A socket another user
// planted at the user's default path (/tmp/tensorshm-$UID in a sticky /tmp), or left in a
// $XDG_RUNTIME_DIR that is not this user's, does not hide the system daemon.
bool IsOwnSocket(const std::string& path) {
  struct stat socket_st {};
  struct stat dir_st {};
  const std::string::size_type slash = path.rfind('/');
  if (slash == std::string::npos) return false;
  const std::string dir = slash == 0 ? "/" : path.substr(0, slash);
  return ::lstat(path.c_str(), &socket_st) == 0 && S_ISSOCK(socket_st.st_mode) &&
         socket_st.st_uid == geteuid() && ::lstat(dir.c_str(), &dir_st) == 0 &&
         S_ISDIR(dir_st.st_mode) && dir_st.st_uid == geteuid() &&
         (dir_st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

bool EnvironmentNamesSocket() {
  const char* path = std::getenv("TENSORSHM_SOCKET");
  return path != nullptr && *path != '\0';
}

}  // namespace

std::string ClientSocketPath() {
  std::string own = DefaultSocketPath();
  if (EnvironmentNamesSocket() || IsOwnSocket(own) || !IsSocket(kSystemSocketPath)) return own;
  return kSystemSocketPath;
}

std::string ClientSocketSource() {
  if (EnvironmentNamesSocket()) return "$TENSORSHM_SOCKET";
  const std::string own = DefaultSocketPath();
  if (IsOwnSocket(own) || !IsSocket(kSystemSocketPath)) return DefaultSocketSource();
  return absl::StrCat("the system daemon's ", kSystemSocketPath,
                      ", as no socket of this user's is at ", DefaultSocketSource());
}

}  // namespace tensorshm
