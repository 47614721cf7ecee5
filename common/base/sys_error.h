// The one wrapper that turns an errno from a system call into an absl::Status.
#ifndef TENSORSHM_COMMON_BASE_SYS_ERROR_H_
#define TENSORSHM_COMMON_BASE_SYS_ERROR_H_

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tensorshm {

// Returns a non-OK Status for `err` (an errno value) from `call` on `resource`:
// "shm_open(/tsm-ab12.cpu.3): No such file or directory". The code follows the errno
// (ENOENT: NOT_FOUND, EEXIST: ALREADY_EXISTS, EACCES/EPERM: PERMISSION_DENIED,
// ENOSPC/ENOMEM/EFBIG: RESOURCE_EXHAUSTED, EINVAL: INVALID_ARGUMENT, else INTERNAL).
absl::Status ErrnoError(absl::string_view call, absl::string_view resource, int err);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_BASE_SYS_ERROR_H_
