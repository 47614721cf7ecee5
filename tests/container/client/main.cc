// `produce SOCKET NAME [SERVER_UID]` publishes 1000 doubles, `consume SOCKET NAME [SERVER_UID]`
// acquires them; each prints the sum of the values it saw. SERVER_UID: the daemon's uid when it
// is not this process's (a sidecar daemon of another user; ClientOptions::server_uid).
#include <tensorshm/client.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: %s produce|consume SOCKET NAME [SERVER_UID]\n", argv[0]);
    return 2;
  }
  tensorshm::ClientOptions options;
  options.socket = argv[2];
  if (argc == 5) options.server_uid = static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 10));
  auto client = tensorshm::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  double sum = 0;
  if (std::strcmp(argv[1], "produce") == 0) {
    auto tensor = (*client)->Create({{kDLFloat, 64, 1}, {1000}});
    if (!tensor.ok()) {
      std::fprintf(stderr, "create: %s\n", tensor.status().ToString().c_str());
      return 1;
    }
    auto* values = static_cast<double*>(tensor->data());
    for (int i = 0; i < 1000; ++i) sum += values[i] = i * 0.5;
    if (tensorshm::Status s = (*client)->Publish(*tensor, argv[3]); !s.ok()) {
      std::fprintf(stderr, "publish %s: %s\n", argv[3], s.ToString().c_str());
      return 1;
    }
  } else {
    auto tensor = (*client)->Acquire(argv[3]);
    if (!tensor.ok()) {
      std::fprintf(stderr, "acquire %s: %s\n", argv[3], tensor.status().ToString().c_str());
      return 1;
    }
    const auto* values = static_cast<const double*>((*tensor)->dl_tensor.data);
    for (int i = 0; i < (*tensor)->dl_tensor.shape[0]; ++i) sum += values[i];
    (*tensor)->deleter(*tensor);
  }
  std::printf("%.1f\n", sum);
  return 0;
}
