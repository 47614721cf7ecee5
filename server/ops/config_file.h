// tensorshmd's --config file: TOML whose keys are the daemon's long flag names.
#ifndef TENSORSHM_SERVER_OPS_CONFIG_FILE_H_
#define TENSORSHM_SERVER_OPS_CONFIG_FILE_H_

#include <string>

#include "absl/status/statusor.h"
#include "server/ops/options.h"

namespace tensorshm {

// Reads the TOML file at `path` into flag values, as if each key were given as "--key value":
//
//   socket = "/run/tensorshm/tensorshm.sock"
//   host-pool = "4Gi"          # a size with its unit (a bare number is refused)
//   max-tensors = 16384
//   keep-segments = true       # a switch: true or false
//   allow-uid = [1000, 1001]   # a repeatable flag: an array (or one value)
//
// Values are checked later, by the flag's own parser (ParseOptions). Returns NOT_FOUND or
// PERMISSION_DENIED (naming the path) if the file cannot be read, INVALID_ARGUMENT naming the
// path, and the line or key, for TOML that does not parse, a key that is no flag (tables
// included), or a value of a type the flag does not take.
absl::StatusOr<FlagValues> ReadConfigFile(const std::string& path);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_OPS_CONFIG_FILE_H_
