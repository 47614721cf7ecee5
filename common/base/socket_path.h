// Where tensorshmd listens by default.
#ifndef TENSORSHM_COMMON_BASE_SOCKET_PATH_H_
#define TENSORSHM_COMMON_BASE_SOCKET_PATH_H_

#include <string>

namespace tensorshm {

// $TENSORSHM_SOCKET, else $XDG_RUNTIME_DIR/tensorshm.sock, else /tmp/tensorshm-$UID/tensorshm.sock.
std::string DefaultSocketPath();

// How DefaultSocketPath() came to its answer, for messages: "$TENSORSHM_SOCKET", or
// "$XDG_RUNTIME_DIR/tensorshm.sock ($TENSORSHM_SOCKET unset)", or "/tmp/tensorshm-$UID
// ($TENSORSHM_SOCKET and $XDG_RUNTIME_DIR unset)".
std::string DefaultSocketSource();

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_BASE_SOCKET_PATH_H_
