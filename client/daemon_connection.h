// Connections to tensorshmd's socket, each checked for who serves it before it carries anything.
// Private to the client library.
#ifndef TENSORSHM_CLIENT_DAEMON_CONNECTION_H_
#define TENSORSHM_CLIENT_DAEMON_CONNECTION_H_

#include <grpcpp/channel.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "client/admin.h"
#include "common/base/unique_fd.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {

// One checked connection to the daemon and the gRPC channel gRPC runs on it. gRPC never makes
// this connection again by itself: once the daemon closes it, calls on the channel fail
// UNAVAILABLE and the client connects (and checks) anew. Thread-safe; immutable.
class DaemonConnection {
 public:
  // Connects (ConnectToDaemon) and builds the channel on that descriptor. Errors as
  // ConnectToDaemon.
  static absl::StatusOr<std::shared_ptr<DaemonConnection>> Connect(
      const std::string& socket, std::optional<uint32_t> server_uid);

  ~DaemonConnection();
  DaemonConnection(const DaemonConnection&) = delete;
  DaemonConnection& operator=(const DaemonConnection&) = delete;

  // The stub of the channel; it keeps the channel alive as long as it is held.
  std::shared_ptr<v1::TensorShm::Stub> stub() const { return stub_; }
  // True once the daemon has hung up this connection (it stopped, died, or closed it). Never
  // blocks.
  bool Broken() const;

 private:
  DaemonConnection(std::shared_ptr<grpc::Channel> channel, UniqueFd watch_fd)
      : channel_(std::move(channel)),
        stub_(v1::TensorShm::NewStub(channel_)),
        watch_fd_(std::move(watch_fd)) {}

  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::TensorShm::Stub> stub_;
  // A duplicate of the descriptor gRPC owns, only ever polled (never read): gRPC's own channel
  // on a descriptor reports no connectivity state.
  const UniqueFd watch_fd_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_DAEMON_CONNECTION_H_
