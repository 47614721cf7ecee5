#include "common/base/socket_path.h"

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

}  // namespace tensorshm
