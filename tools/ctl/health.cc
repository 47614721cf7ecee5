#include "tools/ctl/health.h"

#include <grpcpp/create_channel_posix.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/admin.h"
#include "common/base/unique_fd.h"
#include "common/tensor/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace tensorshm::ctl {

absl::Status CheckHealth(const std::string& socket, std::optional<uint32_t> server_uid,
                         absl::Duration timeout) {
  const std::string where = absl::StrCat("unix:", socket);
  // The client library's own connect and server check: a probe must not trust a socket that a
  // session would refuse.
  absl::StatusOr<UniqueFd> fd = ConnectToDaemon(socket, server_uid);
  if (!fd.ok()) return fd.status();
  // gRPC owns the descriptor from here (it closes it), and never connects anew by itself.
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomInsecureChannelFromFd(where, fd->release(), grpc::ChannelArguments());
  std::unique_ptr<grpc::health::v1::Health::Stub> stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::DeadlineExceededError(absl::StrCat(
        "no answer from ", where, " within ", absl::FormatDuration(timeout),
        " (--timeout): the process serving the socket does not answer gRPC health checks"));
  }
  if (!status.ok()) {
    absl::Status error = FromGrpcStatus(status);
    return absl::Status(error.code(),
                        absl::StrCat("health check at ", where, " failed: ", error.message()));
  }
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensorshmd at ", where, " answers ",
                     grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()),
                     response.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING
                         ? " (it is stopping)"
                         : ""));
  }
  return absl::OkStatus();
}

}  // namespace tensorshm::ctl
