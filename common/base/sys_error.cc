#include "common/base/sys_error.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tensorshm {

absl::Status ErrnoError(absl::string_view call, absl::string_view resource, int err) {
  absl::StatusCode code;
  switch (err) {
    case ENOENT:
      code = absl::StatusCode::kNotFound;
      break;
    case EEXIST:
      code = absl::StatusCode::kAlreadyExists;
      break;
    case EACCES:
    case EPERM:
      code = absl::StatusCode::kPermissionDenied;
      break;
    case ENOSPC:
    case ENOMEM:
    case EFBIG:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case EINVAL:
      code = absl::StatusCode::kInvalidArgument;
      break;
    default:
      code = absl::StatusCode::kInternal;
      break;
  }
  char buffer[256];
  // GNU strerror_r returns the message, which may or may not be `buffer`.
  const char* text = strerror_r(err, buffer, sizeof(buffer));
  return absl::Status(code, absl::StrCat(call, "(", resource, "): ", text));
}

}  // namespace tensorshm
