// tsm_token_client: makes every RPC that names a session with a session token it was handed, as
// whatever process it runs as (tests/integration/token_peer_test.cc runs it as uid 65534, and as
// another process of the token's own uid): a token is worth nothing outside the process that opened
// it.
//
//   tsm_token_client SOCKET TOKEN --tensor-id T --name N [--as-uid U]
//
// T is an unpublished tensor of the token's session, N a name it published. Each call prints
// one line "CALL CODE MESSAGE", in this order:
//   create          Create of 64 bytes
//   create-wait     Create of 64 bytes waiting up to 500 ms for memory (the waiting path)
//   publish         Publish of T as "stolen/T"
//   publish-acquire Publish of T as N with replace and acquire
//   replace         Publish of T as N with replace
//   acquire         Acquire of N
//   acquire-wait    Acquire of "never/published" waiting up to 500 ms
//   delete          Delete of N
//   sessions        Sessions naming the token
//   list            List (needs no session), then "listed K" with K names
//   stat            Stat (needs no session), then "stat sessions S" with S sessions open
// --as-uid U drops to uid and gid U first (needs root). Exit 0, 2 for bad usage, 4 if dropping
// privileges failed.
#include <grp.h>
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace {

namespace v1 = tensorshm::v1;

int Usage() {
  std::cerr << "usage: tsm_token_client SOCKET TOKEN --tensor-id T --name N [--as-uid U]\n";
  return 2;
}

v1::CreateRequest Create64(int64_t wait_ms) {
  v1::CreateRequest request;
  request.mutable_dtype()->set_code(1);  // kDLUInt
  request.mutable_dtype()->set_bits(8);
  request.mutable_dtype()->set_lanes(1);
  request.add_shape(64);
  request.set_wait_ms(wait_ms);
  return request;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return Usage();
  const std::string socket = argv[1];
  const std::string token = argv[2];
  uint64_t tensor_id = 0;
  std::string name;
  int as_uid = -1;
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--tensor-id" && absl::SimpleAtoi(value, &tensor_id)) continue;
    if (flag == "--name") {
      name = value;
      continue;
    }
    if (flag == "--as-uid" && absl::SimpleAtoi(value, &as_uid)) continue;
    return Usage();
  }
  if (argc % 2 == 0 || tensor_id == 0 || name.empty()) return Usage();
  if (as_uid >= 0 && (setgroups(0, nullptr) != 0 || setgid(as_uid) != 0 || setuid(as_uid) != 0)) {
    std::cerr << "cannot drop privileges to uid " << as_uid << "\n";
    return 4;
  }

  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  std::unique_ptr<v1::TensorShm::Stub> stub = v1::TensorShm::NewStub(channel);
  // Every call names the token, as its own session's client would.
  auto call = [&](const std::string& what,
                  const std::function<grpc::Status(grpc::ClientContext*)>& make) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    context.AddMetadata("tensorshm-session", token);
    const grpc::Status status = make(&context);
    std::cout << what << " " << static_cast<int>(status.error_code()) << " "
              << status.error_message() << std::endl;
  };

  v1::CreateResponse created;
  call("create", [&](grpc::ClientContext* c) { return stub->Create(c, Create64(0), &created); });
  call("create-wait",
       [&](grpc::ClientContext* c) { return stub->Create(c, Create64(500), &created); });
  const auto publish = [&](const std::string& as, bool replace, bool acquire) {
    v1::PublishRequest request;
    request.set_tensor_id(tensor_id);
    request.set_name(as);
    request.set_replace(replace);
    request.set_acquire(acquire);
    return [request, &stub](grpc::ClientContext* c) {
      v1::PublishResponse response;
      return stub->Publish(c, request, &response);
    };
  };
  call("publish", publish(absl::StrCat("stolen/", tensor_id), false, false));
  call("publish-acquire", publish(name, true, true));
  call("replace", publish(name, true, false));
  const auto acquire = [&](const std::string& of, int64_t wait_ms) {
    v1::AcquireRequest request;
    request.set_name(of);
    request.set_wait_ms(wait_ms);
    return [request, &stub](grpc::ClientContext* c) {
      v1::AcquireResponse response;
      return stub->Acquire(c, request, &response);
    };
  };
  call("acquire", acquire(name, 0));
  call("acquire-wait", acquire("never/published", 500));
  call("delete", [&](grpc::ClientContext* c) {
    v1::DeleteRequest request;
    request.set_name(name);
    v1::DeleteResponse response;
    return stub->Delete(c, request, &response);
  });
  call("sessions", [&](grpc::ClientContext* c) {
    v1::SessionsResponse response;
    return stub->Sessions(c, v1::SessionsRequest(), &response);
  });
  v1::ListResponse listed;
  call("list", [&](grpc::ClientContext* c) { return stub->List(c, v1::ListRequest(), &listed); });
  std::cout << "listed " << listed.tensors_size() << std::endl;
  v1::StatResponse stat;
  call("stat", [&](grpc::ClientContext* c) { return stub->Stat(c, v1::StatRequest(), &stat); });
  std::cout << "stat sessions " << stat.sessions() << std::endl;
  return 0;
}
