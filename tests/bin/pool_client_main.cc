// tsm_pool_client: a producer for the full-pool tests (tests/integration/full_pool_test.cc).
//
//   tsm_pool_client create SOCKET BYTES TIMEOUT_MS [NAME]
//       connects (prints "connected"), creates a uint8 tensor of BYTES bytes through
//       Client::Create, waiting up to TIMEOUT_MS for memory (-1: forever; 0: no wait), and prints
//       "created" (then, with NAME, publishes it and prints "published"), or
//       "error <code> <message>" and exits 3.
#include <cstdio>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "tensorshm/client.h"

namespace {

int Fail(const tensorshm::Status& status) {
  std::cout << "error " << static_cast<int>(status.code()) << " " << status.message() << std::endl;
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t bytes = 0;
  int64_t timeout_ms = 0;
  if (argc < 5 || std::string(argv[1]) != "create" || !absl::SimpleAtoi(argv[3], &bytes) ||
      !absl::SimpleAtoi(argv[4], &timeout_ms)) {
    std::cerr << "usage: tsm_pool_client create SOCKET BYTES TIMEOUT_MS [NAME]\n";
    return 2;
  }
  tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> client =
      tensorshm::Client::Connect(tensorshm::ClientOptions{argv[2], "tsm_pool_client"});
  if (!client.ok()) return Fail(client.status());
  std::cout << "connected" << std::endl;
  const tensorshm::Duration timeout =
      timeout_ms < 0 ? tensorshm::kForever : std::chrono::milliseconds(timeout_ms);
  tensorshm::StatusOr<tensorshm::WritableTensor> tensor =
      (*client)->Create(tensorshm::TensorSpec{{kDLUInt, 8, 1}, {bytes}}, timeout);
  if (!tensor.ok()) return Fail(tensor.status());
  std::cout << "created" << std::endl;
  if (argc > 5) {
    if (tensorshm::Status s = (*client)->Publish(*tensor, argv[5]); !s.ok()) return Fail(s);
    std::cout << "published" << std::endl;
  }
  return 0;
}
