// A client that waits in the daemon: opens a session over raw gRPC and sends one Acquire with
// wait_ms, as a client without the fast path (another language's) does; the C++ and Python
// clients wait for host tensors in shared memory instead, unseen by the daemon. Prints
// "acquire: CODE" when the answer comes, releases the lease it got, and closes its session.
//
//   tsm_metrics_acquirer SOCKET NAME WAIT_MS
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s SOCKET NAME WAIT_MS\n", argv[0]);
    return 2;
  }
  const std::string socket = argv[1];
  const std::string name = argv[2];
  const long long wait_ms = std::atoll(argv[3]);
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  auto stub = tensorshm::v1::TensorShm::NewStub(channel);

  grpc::ClientContext stream_context;
  auto stream = stub->Session(&stream_context);
  tensorshm::v1::SessionRequest open;
  open.mutable_open()->set_pid(getpid());
  open.mutable_open()->set_client_name("metrics_acquirer");
  tensorshm::v1::SessionResponse opened;
  if (!stream->Write(open) || !stream->Read(&opened) || !opened.has_opened()) {
    std::fprintf(stderr, "session: not opened (%s)\n", stream->Finish().error_message().c_str());
    return 1;
  }

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(wait_ms) +
                       std::chrono::seconds(30));
  context.AddMetadata("tensorshm-session", opened.opened().session_id());
  tensorshm::v1::AcquireRequest request;
  request.set_name(name);
  request.set_wait_ms(wait_ms);
  tensorshm::v1::AcquireResponse response;
  const grpc::Status status = stub->Acquire(&context, request, &response);
  std::printf("acquire: %s\n",
              absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())).c_str());
  std::fflush(stdout);

  if (status.ok()) {
    tensorshm::v1::SessionRequest release;
    release.mutable_release()->set_sequence(1);
    release.mutable_release()->add_lease_ids(response.lease_id());
    tensorshm::v1::SessionResponse ack;
    if (!stream->Write(release) || !stream->Read(&ack) || ack.ack().rejected_size() != 0) {
      std::fprintf(stderr, "release: not acknowledged\n");
      return 1;
    }
  }
  stream->WritesDone();
  const grpc::Status closed = stream->Finish();
  if (!closed.ok()) {
    std::fprintf(stderr, "session: %s\n", closed.error_message().c_str());
    return 1;
  }
  return 0;
}
