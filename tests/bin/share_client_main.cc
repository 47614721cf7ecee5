// tsm_share_client: one uid's producer for the pool-sharing tests
// (tests/integration/pool_share_test.cc), through the client library (Create, Publish, Acquire,
// Delete); run as another uid with `setpriv --reuid U --regid U --clear-groups`.
//
//   tsm_share_client put SOCKET PREFIX FIRST COUNT BYTES
//       creates and publishes tensors PREFIX.FIRST .. PREFIX.(FIRST+COUNT-1) of BYTES bytes, each
//       filled with its own pattern; COUNT -1: until refused. Prints "put K" (K published), and
//       "refused CODE MESSAGE" if a create was refused.
//   tsm_share_client check SOCKET PREFIX COUNT
//       acquires PREFIX.0 .. PREFIX.(COUNT-1) and checks every byte: "checked K", or
//       "wrong NAME ..." and exit 3.
//   tsm_share_client delete SOCKET PREFIX COUNT
//       deletes PREFIX.0 .. PREFIX.(COUNT-1): "deleted K".
// Exit 0, 2 for bad usage, 3 on an unexpected error (printed as "error CODE MESSAGE").
#include <cstdint>
#include <cstring>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tensorshm/client.h"

namespace {

int Fail(const tensorshm::Status& status) {
  std::cout << "error " << static_cast<int>(status.code()) << " " << status.message() << std::endl;
  return 3;
}

// Tensor `name`'s seed (FNV-1a of the name), hashed once per tensor: per byte, the hash took
// most of a put's time under ASan's -O0.
uint64_t Seed(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

// The byte at `offset` of the tensor whose seed is `seed`.
uint8_t Pattern(uint64_t seed, uint64_t offset) {
  return static_cast<uint8_t>((seed >> 24) + offset * 131 + (offset >> 9));
}

std::string NameOf(const std::string& prefix, int64_t i) { return absl::StrCat(prefix, ".", i); }

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  int64_t first = 0, count = 0, bytes = 0;
  const bool usage_ok =
      (mode == "put" && argc == 7 && absl::SimpleAtoi(argv[4], &first) &&
       absl::SimpleAtoi(argv[5], &count) && absl::SimpleAtoi(argv[6], &bytes) && bytes > 0) ||
      ((mode == "check" || mode == "delete") && argc == 5 && absl::SimpleAtoi(argv[4], &count));
  if (!usage_ok) {
    std::cerr << "usage: tsm_share_client put|check|delete SOCKET PREFIX ... (see the source)\n";
    return 2;
  }
  const std::string prefix = argv[3];
  tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> client =
      tensorshm::Client::Connect(tensorshm::ClientOptions{argv[2], "tsm_share_client"});
  if (!client.ok()) return Fail(client.status());
  tensorshm::Client& c = **client;

  if (mode == "put") {
    int64_t put = 0;
    for (int64_t i = first; count < 0 || i < first + count; ++i) {
      tensorshm::StatusOr<tensorshm::WritableTensor> tensor =
          c.Create(tensorshm::TensorSpec{{kDLUInt, 8, 1}, {bytes}});
      if (tensor.status().code() == tensorshm::StatusCode::kResourceExhausted) {
        std::cout << "put " << put << std::endl;
        std::cout << "refused " << static_cast<int>(tensor.status().code()) << " "
                  << tensor.status().message() << std::endl;
        return 0;
      }
      if (!tensor.ok()) return Fail(tensor.status());
      const std::string name = NameOf(prefix, i);
      auto* data = static_cast<uint8_t*>(tensor->data());
      const uint64_t seed = Seed(name);
      for (int64_t b = 0; b < bytes; ++b) data[b] = Pattern(seed, b);
      if (tensorshm::Status s = c.Publish(*tensor, name); !s.ok()) return Fail(s);
      ++put;
    }
    std::cout << "put " << put << std::endl;
    return 0;
  }
  int64_t done = 0;
  for (int64_t i = 0; i < count; ++i) {
    const std::string name = NameOf(prefix, i);
    if (mode == "delete") {
      if (tensorshm::Status s = c.Delete(name); !s.ok()) return Fail(s);
      ++done;
      continue;
    }
    tensorshm::StatusOr<DLManagedTensorVersioned*> held = c.Acquire(name);
    if (!held.ok()) return Fail(held.status());
    const DLTensor& t = (*held)->dl_tensor;
    const auto* data = static_cast<const uint8_t*>(t.data) + t.byte_offset;
    const int64_t length = t.shape[0];
    const uint64_t seed = Seed(name);
    for (int64_t b = 0; b < length; ++b) {
      if (data[b] != Pattern(seed, b)) {
        std::cout << "wrong " << name << " byte " << b << std::endl;
        (*held)->deleter(*held);
        return 3;
      }
    }
    (*held)->deleter(*held);
    ++done;
  }
  std::cout << (mode == "delete" ? "deleted " : "checked ") << done << std::endl;
  return 0;
}
