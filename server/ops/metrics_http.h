// The HTTP side of --metrics: serves RenderMetrics' text at GET /metrics (cpp-httplib), every
// other path 404. Read-only, and the figures hold no tensor names; but anyone who can reach the
// address reads them: bound beyond loopback, they are exposed to that network.
#ifndef TENSORSHM_SERVER_OPS_METRICS_HTTP_H_
#define TENSORSHM_SERVER_OPS_METRICS_HTTP_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace httplib {
class Server;
}

namespace tensorshm {

// A --metrics value: HOST:PORT, the host an IPv4 address, a name, or an IPv6 address in
// brackets; port 0 takes any free port.
struct MetricsAddress {
  std::string host;  // without the brackets of an IPv6 address
  int port = 0;
};

// Parses a --metrics value ("127.0.0.1:9464", "[::1]:9464", "localhost:0"). INVALID_ARGUMENT
// naming --metrics and the value otherwise.
absl::StatusOr<MetricsAddress> ParseMetricsAddress(absl::string_view text);

// "127.0.0.1:9464", "[::1]:9464".
std::string FormatMetricsAddress(const MetricsAddress& address);

// Whether `host` is a loopback address or "localhost".
bool IsLoopbackHost(absl::string_view host);

// Serves GET /metrics on a thread of its own (and a pool of two for the requests) until Stop
// or destruction. `render` is called once per request, on those threads: it must be thread-safe
// and must not take long locks.
class MetricsServer {
 public:
  // Binds `address` and starts serving. INVALID_ARGUMENT or UNAVAILABLE naming --metrics and
  // the value if the host does not resolve or the port cannot be bound (in use, not an address
  // of this machine).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const MetricsAddress& address,
                                                              std::function<std::string()> render);
  ~MetricsServer();

  // The address served, with the port bound (the one chosen for port 0).
  const MetricsAddress& address() const { return address_; }
  // Stops listening, ends the requests in progress (within a second or two) and joins the
  // threads. Idempotent.
  void Stop();

 private:
  MetricsServer() = default;

  MetricsAddress address_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> done_{false};  // listen_after_bind returned
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_OPS_METRICS_HTTP_H_
