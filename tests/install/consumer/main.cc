// A program outside the tree: `produce SOCKET NAME` publishes 1000 doubles, `consume SOCKET NAME`
// acquires them; each prints the sum of the values it saw. Built by CMake with no standard set
// (tensorshm::client asks for C++20) and by hand with -std=c++20 and pkg-config, which names no
// abseil: the API is the library's own (tensorshm/status.h).
#include <tensorshm/client.h>

#include <chrono>
#include <cstdio>
#include <cstring>

static_assert(__cplusplus >= 202002L, "tensorshm::client passes C++20 on to its users");

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  tensorshm::ClientOptions options;
  options.socket = argv[2];
  auto client = tensorshm::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return 1;
  }
  double sum = 0;
  if (std::strcmp(argv[1], "produce") == 0) {
    auto tensor = (*client)->Create({{kDLFloat, 64, 1}, {1000}});
    if (!tensor.ok()) return 1;
    auto* values = static_cast<double*>(tensor->data());
    for (int i = 0; i < 1000; ++i) sum += values[i] = i * 0.5;
    if (!(*client)->Publish(*tensor, argv[3]).ok()) return 1;
  } else {
    tensorshm::StatusOr<DLManagedTensorVersioned*> tensor =
        (*client)->Acquire(argv[3], std::chrono::seconds(5));
    if (!tensor.ok()) return 1;
    try {  // an error's value() throws the library's exception, caught here by its type
      (void)(*client)->Acquire("never/published").value();
      return 1;
    } catch (const tensorshm::BadStatusOrAccess& e) {
      if (e.status().code() != tensorshm::StatusCode::kNotFound) return 1;
    }
    const auto* values = static_cast<const double*>((*tensor)->dl_tensor.data);
    for (int i = 0; i < (*tensor)->dl_tensor.shape[0]; ++i) sum += values[i];
    (*tensor)->deleter(*tensor);
  }
  std::printf("%.1f\n", sum);
  return 0;
}
