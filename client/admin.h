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

// `given` (ClientOptions::server_uid, a --server-uid flag) when set, else $TENSORSHM_SERVER_UID
// (a uid), else none. INVALID_ARGUMENT naming the variable for a value that is not a uid.
absl::StatusOr<std::optional<uint32_t>> ServerUidOrEnvironment(std::optional<uint32_t> given);

// Whether `socket` is the packaged daemon's (kSystemSocketPath, spelled exactly) and lies in a
// directory that only root could have made for uid `server`: /run/tensorshm is `server`'s and
// writable by it alone, every directory above it is root's and writable by root alone (no
// symbolic link on the way), and `socket` is a socket. systemd's RuntimeDirectory= makes it so;
// no other user can make that directory, or put a socket in it.
bool InDirectoryRootMadeFor(const std::string& socket, uint32_t server);

// Connects a new stream socket (blocking, close-on-exec) to the daemon's socket `socket` and
// checks who serves it, with SO_PEERCRED on that very connection: the server's uid must be this
// process's effective uid, root, `server_uid` when given (ClientOptions::server_uid), or the
// owner of /run/tensorshm where root made that directory for it (InDirectoryRootMadeFor). Another
// local user could otherwise have made the socket's path first and serve it, and read or write
// every tensor the client hands it. Returns the connected descriptor. UNAVAILABLE if nothing
// accepts the connection (no daemon, no socket); PERMISSION_DENIED naming the socket, the server's
// uid and pid, the uids expected and the option that adds one.
absl::StatusOr<UniqueFd> ConnectToDaemon(const std::string& socket,
                                         std::optional<uint32_t> server_uid);

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_ADMIN_H_
