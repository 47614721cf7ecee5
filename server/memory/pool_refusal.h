// A pool's refusal that no amount of freeing can lift: the request is larger than the whole pool.
// A create that waits for memory (CreateRequest.wait_ms) must not wait for it, so the
// RESOURCE_EXHAUSTED status carries a payload saying so (within the daemon only: it is not sent).
#ifndef TENSORSHM_SERVER_MEMORY_POOL_REFUSAL_H_
#define TENSORSHM_SERVER_MEMORY_POOL_REFUSAL_H_

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"

namespace tensorshm {

inline constexpr absl::string_view kNeverFitsPayload = "tensorshm.pool/never-fits";

// RESOURCE_EXHAUSTED with `message`, marked as never satisfiable.
inline absl::Status NeverFitsError(absl::string_view message) {
  absl::Status status = absl::ResourceExhaustedError(message);
  status.SetPayload(kNeverFitsPayload, absl::Cord("1"));
  return status;
}

inline bool NeverFits(const absl::Status& status) {
  return status.GetPayload(kNeverFitsPayload).has_value();
}

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_MEMORY_POOL_REFUSAL_H_
