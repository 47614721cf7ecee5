// What the Store lists for anyone admitted (List, Sessions), in the daemon's own terms: the gRPC
// service writes them as TensorInfo and SessionInfo (server/rpc/wire_results.h).
#ifndef TENSORSHM_SERVER_CORE_LISTINGS_H_
#define TENSORSHM_SERVER_CORE_LISTINGS_H_

#include <cstdint>
#include <string>

#include "common/tensor/layout.h"

namespace tensorshm {

// A bound name and its tensor.
struct TensorListing {
  std::string name;
  uint64_t tensor_id = 0;
  DecodedTensor desc;  // its layout, as an acquire describes it
  int64_t leases = 0;  // every client's, RPC and fast path together
  int64_t published_unix_ms = 0;
  uint32_t publisher_uid = 0;
  int64_t publisher_pid = 0;  // 0 when the caller may not see it (another uid's tensor)
};

// An open session. A session the caller may not see the details of is `redacted`: pid, gid,
// client name and version left empty.
struct SessionListing {
  uint64_t session_id = 0;
  uint32_t uid = 0;
  int64_t pid = 0;
  uint32_t gid = 0;
  std::string client_name;
  std::string client_version;
  int64_t rpc_leases = 0;
  int64_t page_leases = 0;
  int64_t unpublished_tensors = 0;
  int64_t unpublished_bytes = 0;
  int64_t waiting_acquires = 0;
  int64_t opened_unix_ms = 0;
  bool own = false;  // the caller's own session
  bool redacted = false;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_LISTINGS_H_
