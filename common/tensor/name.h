// Validation of the names tensors are published under, and of the other strings a client
// gives the daemon to keep.
#ifndef TENSORSHM_COMMON_TENSOR_NAME_H_
#define TENSORSHM_COMMON_TENSOR_NAME_H_

#include <string>
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

// Most bytes of each string a client supplies that the daemon keeps for the life of a session
// (SessionOpen.client_name, SessionOpen.client_version).
inline constexpr size_t kMaxClientText = 256;

// OK if both fit kMaxClientText; INVALID_ARGUMENT naming the first field that does not
// ("open.client_name") and its length otherwise. The daemon refuses such a session before it
// keeps anything of it.
absl::Status ValidateClientText(const std::string& client_name, const std::string& client_version);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_TENSOR_NAME_H_
