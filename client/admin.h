// What tensorshmctl needs of the client library beyond the public API (include/tensorshm/): a
// connection to the daemon's socket checked as every session's is. Not exported by libtensorshm:
// tensorshmctl links the library's objects.
#ifndef TENSORSHM_CLIENT_ADMIN_H_
#define TENSORSHM_CLIENT_ADMIN_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/unique_fd.h"

namespace tensorshm {

// Connects a new stream socket (blocking, close-on-exec) to the daemon's socket `socket` and
// checks who serves it, with SO_PEERCRED on that very connection: the server's uid must be this
// process's effective uid, root, or `server_uid` when given (ClientOptions::server_uid). Another
// local user could otherwise have made the socket's path first and serve it, and read or write
// every tensor the client hands it. Returns the connected descriptor.
// UNAVAILABLE if nothing accepts the connection (no daemon, no socket); PERMISSION_DENIED naming
// the socket, the server's uid and pid, the uids expected and the option that adds one.
absl::StatusOr<UniqueFd> ConnectToDaemon(const std::string& socket,
                                         std::optional<uint32_t> server_uid);

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_ADMIN_H_
