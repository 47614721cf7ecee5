// tensorshmctl health: the standard gRPC health check (grpc.health.v1.Health/Check) on the
// daemon's socket, without opening a tensorshm session, so that a probe run every few seconds
// leaves no trace in the daemon beyond one short connection.
#ifndef TENSORSHM_TOOLS_CTL_HEALTH_H_
#define TENSORSHM_TOOLS_CTL_HEALTH_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace tensorshm::ctl {

// Connects to `socket`, checks who serves it as the client library does (SO_PEERCRED: this
// process's uid, root, or `server_uid`), and asks for the overall health ("" service) within
// `timeout`. OK only when the answer is SERVING. Otherwise a one-line reason:
// UNAVAILABLE when the socket is missing or nobody accepts on it, or the connection broke;
// DEADLINE_EXCEEDED when nobody answered within `timeout`; PERMISSION_DENIED for a server of an
// untrusted uid (or a daemon that refuses this uid); FAILED_PRECONDITION when the daemon answers
// NOT_SERVING (it is stopping) or another status.
absl::Status CheckHealth(const std::string& socket, std::optional<uint32_t> server_uid,
                         absl::Duration timeout);

}  // namespace tensorshm::ctl

#endif  // TENSORSHM_TOOLS_CTL_HEALTH_H_
