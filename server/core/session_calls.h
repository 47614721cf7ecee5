// What a session stream brings to the Store and gets back from it, in the daemon's own terms:
// the gRPC session reactor reads them from SessionOpen and ReleaseBatch and writes them as
// SessionOpened and ReleaseAck (server/rpc/wire_results.h; the .proto says what each means).
#ifndef TENSORSHM_SERVER_CORE_SESSION_CALLS_H_
#define TENSORSHM_SERVER_CORE_SESSION_CALLS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace tensorshm {

// A session's opening. A client that reconnects lists what it held of the daemon before.
struct SessionOpening {
  std::string client_name;                // at most kMaxClientText bytes
  std::string client_version;             // at most kMaxClientText bytes
  int64_t pid = 0;                        // the client's word; the kernel's, when it has one, wins
  std::vector<uint64_t> held_tensor_ids;  // leases to take back
  std::vector<uint64_t> unpublished_tensor_ids;  // unpublished buffers to take back
};

// The session opened.
struct OpenedSession {
  std::string token;  // the session's secret (SessionOpened.session_id)
  uint64_t session_number = 0;
  uint64_t instance_id = 0;         // this daemon's
  std::vector<uint64_t> lease_ids;  // per held_tensor_ids: the new lease, or 0 if not taken back
  std::vector<bool> readopted;      // per unpublished_tensor_ids
  // The host segments alive: (segment instance, segment id).
  std::vector<std::pair<uint64_t, uint64_t>> segments;
};

// Leases and unpublished buffers a session lets go of, and waited calls it settled.
struct Releases {
  uint64_t sequence = 0;  // echoed in the answer
  std::vector<uint64_t> lease_ids;
  std::vector<uint64_t> abandoned_tensor_ids;
  std::vector<uint64_t> settled_request_ids;
};

// What of a Releases the Store refused: each a lease or tensor id (0 for the whole batch) and
// why.
struct ReleasesDone {
  struct Refused {
    uint64_t id = 0;
    absl::Status status;
  };
  uint64_t sequence = 0;
  std::vector<Refused> refused;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_SESSION_CALLS_H_
