// Where tensorshmd listens by default, and where clients look for it.
#ifndef TENSORSHM_COMMON_BASE_SOCKET_PATH_H_
#define TENSORSHM_COMMON_BASE_SOCKET_PATH_H_

#include <string>

namespace tensorshm {

// The packaged daemon's socket: its systemd unit serves here (RuntimeDirectory=tensorshm).
inline constexpr char kSystemSocketPath[] = "/run/tensorshm/tensorshm.sock";

// A daemon's own default: $TENSORSHM_SOCKET, else $XDG_RUNTIME_DIR/tensorshm.sock, else
// /tmp/tensorshm-$UID/tensorshm.sock.
std::string DefaultSocketPath();

// How DefaultSocketPath() came to its answer, for messages: "$TENSORSHM_SOCKET", or
// "$XDG_RUNTIME_DIR/tensorshm.sock ($TENSORSHM_SOCKET unset)", or "/tmp/tensorshm-$UID
// ($TENSORSHM_SOCKET and $XDG_RUNTIME_DIR unset)".
std::string DefaultSocketSource();

// A client's default, in this order: $TENSORSHM_SOCKET; the user's own daemon's socket
// (DefaultSocketPath()) when a socket is there; the system daemon's (kSystemSocketPath) when a
// socket is there; else the user's own (for the message that no daemon serves it).
std::string ClientSocketPath();

// How ClientSocketPath() came to its answer, for messages.
std::string ClientSocketSource();

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_BASE_SOCKET_PATH_H_
