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

bool EnvironmentNamesSocket() {
  const char* path = std::getenv("TENSORSHM_SOCKET");
  return path != nullptr && *path != '\0';
}

}  // namespace

std::string ClientSocketPath() {
  std::string own = DefaultSocketPath();
  if (EnvironmentNamesSocket() || IsSocket(own) || !IsSocket(kSystemSocketPath)) return own;
  return kSystemSocketPath;
}

std::string ClientSocketSource() {
  if (EnvironmentNamesSocket()) return "$TENSORSHM_SOCKET";
  const std::string own = DefaultSocketPath();
  if (IsSocket(own)) return DefaultSocketSource();
  if (IsSocket(kSystemSocketPath)) {
    return absl::StrCat("the system daemon's ", kSystemSocketPath, ", as no socket is at ",
                        DefaultSocketSource());
  }
  return absl::StrCat(DefaultSocketSource(), "; nor is the system daemon's ", kSystemSocketPath,
                      " there");
}

}  // namespace tensorshm
