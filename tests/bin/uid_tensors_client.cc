// tsm_uid_tensors_client: one uid's producer for the --uid-tensors tests
// (tests/integration/uid_tensors_test.cc), through the client library; run as another uid with
// `setpriv --reuid U --regid U --clear-groups`.
//
//   tsm_uid_tensors_client put SOCKET PREFIX COUNT BYTES
//       creates and publishes host tensors PREFIX.0 .. PREFIX.(COUNT-1) of BYTES bytes (0: empty
//       tensors, shape [0]), each byte i of tensor k set to (k + i) % 251; prints "put K" (K
//       published), and "refused CODE MESSAGE" for the first create or publish refused (the rest
//       are not tried).
//   tsm_uid_tensors_client count SOCKET PREFIX
//       lists the names starting with PREFIX: "listed K".
// Exit 0, 2 for bad usage, 3 if the daemon cannot be reached.
#include <cstdint>
#include <cstring>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tensorshm/client.h"

namespace {

void Print(const char* what, const tensorshm::Status& status) {
  std::cout << what << " " << static_cast<int>(status.code()) << " " << status.message()
            << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  int64_t count = 0, bytes = 0;
  const bool usage_ok = (mode == "count" && argc == 4) ||
                        (mode == "put" && argc == 6 && absl::SimpleAtoi(argv[4], &count) &&
                         absl::SimpleAtoi(argv[5], &bytes) && bytes >= 0);
  if (!usage_ok) {
    std::cerr << "usage: tsm_uid_tensors_client put|count SOCKET PREFIX ... (see the source)\n";
    return 2;
  }
  const std::string prefix = argv[3];
  tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> client =
      tensorshm::Client::Connect(tensorshm::ClientOptions{argv[2], "tsm_uid_tensors_client"});
  if (!client.ok()) {
    Print("error", client.status());
    return 3;
  }
  tensorshm::Client& c = **client;

  if (mode == "count") {
    tensorshm::StatusOr<std::vector<tensorshm::TensorInfo>> listed = c.List(prefix);
    if (!listed.ok()) {
      Print("error", listed.status());
      return 3;
    }
    std::cout << "listed " << listed->size() << std::endl;
    return 0;
  }
  int64_t put = 0;
  for (int64_t k = 0; k < count; ++k) {
    tensorshm::StatusOr<tensorshm::WritableTensor> tensor =
        c.Create(tensorshm::TensorSpec{{kDLUInt, 8, 1}, {bytes}});
    if (!tensor.ok()) {
      std::cout << "put " << put << std::endl;
      Print("refused", tensor.status());
      return 0;
    }
    auto* data = static_cast<uint8_t*>(tensor->data());
    for (int64_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>((k + i) % 251);
    if (tensorshm::Status s = c.Publish(*tensor, absl::StrCat(prefix, ".", k)); !s.ok()) {
      std::cout << "put " << put << std::endl;
      Print("refused", s);
      return 0;
    }
    ++put;
  }
  std::cout << "put " << put << std::endl;
  return 0;
}
