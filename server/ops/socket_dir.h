// The daemon's socket path: which directories it may live in, made safe before the daemon binds.
#ifndef TENSORSHM_SERVER_OPS_SOCKET_DIR_H_
#define TENSORSHM_SERVER_OPS_SOCKET_DIR_H_

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"

namespace tensorshm {

// Makes `path` ready for the daemon (euid `euid`) to bind: creates missing directories (mode
// 0700, or 0711 with `shared` so that admitted users can reach the socket), checks that no other
// user can replace anything on the way, and removes a stale socket left by a daemon that died.
//
// The rule (issue 11: another local user must not be able to squat the path or swap the socket):
//   - No component is a symbolic link: each is opened with O_NOFOLLOW, so a link planted in the
//     path is refused (named), never followed.
//   - The socket's own directory is one the daemon creates, or an existing one owned by `euid`
//     and not writable by group or others. A root-owned directory with the sticky bit (/tmp) is
//     accepted as the direct parent too: others can add entries there but cannot remove or rename
//     the socket the daemon binds, and clients check who serves the socket (SO_PEERCRED).
//   - Every directory above it is owned by root or `euid` and not writable by group or others,
//     unless it has the sticky bit (/tmp): else another user could rename the socket's directory
//     away and put their own in its place after these checks.
//   - An existing entry at `path` must be a socket owned by `euid`; it is removed if no daemon
//     answers on it.
// Errors: INVALID_ARGUMENT for a path too long for a Unix socket or naming no file;
// FAILED_PRECONDITION naming the path, its owner uid and mode and the fix for a directory or
// entry that breaks the rule, or if a live daemon already serves on `path`; other codes for
// failed system calls (named).
absl::Status PrepareSocketPath(const std::string& path, bool shared, uid_t euid);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_OPS_SOCKET_DIR_H_
