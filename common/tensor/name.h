// Validation of the names tensors are published under.
#ifndef TENSORSHM_COMMON_TENSOR_NAME_H_
#define TENSORSHM_COMMON_TENSOR_NAME_H_

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tensorshm {

inline constexpr size_t kMaxNameLength = 255;

// Returns OK if `name` is a valid tensor name: 1-255 bytes of [A-Za-z0-9._:/-], no leading '/',
// and no empty, "." or ".." path element. Otherwise INVALID_ARGUMENT naming `field` and the
// offending value or character.
absl::Status ValidateName(absl::string_view name, absl::string_view field = "name");

// Returns OK if `prefix` is usable as a List prefix: empty, or at most 255 bytes of the name
// alphabet. INVALID_ARGUMENT otherwise.
absl::Status ValidateNamePrefix(absl::string_view prefix, absl::string_view field = "prefix");

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_TENSOR_NAME_H_
