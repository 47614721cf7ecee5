#include "server/ops/metrics_http.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tensorshm {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";
// Requests are a scraper's, one at a time: two threads serve them.
constexpr size_t kRequestThreads = 2;
// How long an idle or slow connection may hold a request thread; Stop waits at most about this.
constexpr time_t kReadTimeoutSeconds = 2;
constexpr time_t kKeepAliveSeconds = 1;

absl::Status BadAddress(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("--metrics = \"", text, "\": ", why));
}

}  // namespace

absl::StatusOr<MetricsAddress> ParseMetricsAddress(absl::string_view text) {
  constexpr absl::string_view kForm =
      "expected HOST:PORT, e.g. 127.0.0.1:9464 or [::1]:9464 (port 0: any free port)";
  MetricsAddress address;
  absl::string_view port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return BadAddress(text, kForm);
    }
    address.host = std::string(text.substr(1, close - 1));
    port = text.substr(close + 2);
    in6_addr v6;
    if (inet_pton(AF_INET6, address.host.c_str(), &v6) != 1) {
      return BadAddress(text, "the address in brackets is not an IPv6 address");
    }
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) return BadAddress(text, kForm);
    address.host = std::string(text.substr(0, colon));
    port = text.substr(colon + 1);
    if (address.host.find(':') != std::string::npos) {
      return BadAddress(text, "an IPv6 address goes in brackets, e.g. [::1]:9464");
    }
    for (char c : address.host) {
      if (!absl::ascii_isalnum(c) && c != '.' && c != '-' && c != '_') {
        return BadAddress(text, absl::StrCat("the host has a '", std::string(1, c),
                                             "'; use an address or a host name"));
      }
    }
  }
  if (address.host.empty()) {
    return BadAddress(text, absl::StrCat("no host; ", kForm));
  }
  if (port.empty() || !absl::ascii_isdigit(port.front()) ||
      !absl::SimpleAtoi(port, &address.port) || address.port > 65535) {
    return BadAddress(text, "the port must be a number from 0 to 65535 (0: any free port)");
  }
  return address;
}

std::string FormatMetricsAddress(const MetricsAddress& address) {
  return address.host.find(':') != std::string::npos
             ? absl::StrCat("[", address.host, "]:", address.port)
             : absl::StrCat(address.host, ":", address.port);
}

bool IsLoopbackHost(absl::string_view host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr v4;
  const std::string text(host);
  return inet_pton(AF_INET, text.c_str(), &v4) == 1 && (ntohl(v4.s_addr) >> 24) == 127;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const MetricsAddress& address, std::function<std::string()> render) {
  const std::string text = FormatMetricsAddress(address);
  // Resolved here first, so that a host that does not resolve says so (httplib would only
  // fail to bind).
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int err = getaddrinfo(address.host.c_str(), nullptr, &hints, &found); err != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics = \"", text, "\": host \"",
                                                   address.host, "\" does not resolve (",
                                                   gai_strerror(err), ")"));
  }
  freeaddrinfo(found);

  std::unique_ptr<MetricsServer> metrics(new MetricsServer());
  metrics->address_ = address;
  metrics->server_ = std::make_unique<httplib::Server>();
  httplib::Server& server = *metrics->server_;
  server.new_task_queue = [] { return new httplib::ThreadPool(kRequestThreads); };
  server.set_read_timeout(kReadTimeoutSeconds);
  server.set_write_timeout(kReadTimeoutSeconds);
  server.set_keep_alive_timeout(kKeepAliveSeconds);
  server.set_payload_max_length(4096);
  // httplib's default also sets SO_REUSEPORT, which would let a second daemon share the port.
  server.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.Get("/metrics",
             [render = std::move(render)](const httplib::Request&, httplib::Response& response) {
               response.set_content(render(), kContentType);
             });

  errno = 0;
  int port = address.port;
  if (address.port == 0) {
    port = server.bind_to_any_port(address.host);
  } else if (!server.bind_to_port(address.host, address.port)) {
    port = -1;
  }
  if (port <= 0) {
    const int err = errno;
    return absl::UnavailableError(absl::StrCat(
        "--metrics = \"", text, "\": cannot listen there",
        err != 0 ? absl::StrCat(" (", std::strerror(err), ")") : std::string(),
        ": the port is in use or the host is not an address of this machine; choose another "
        "port, or 0 for any free one"));
  }
  metrics->address_.port = port;
  metrics->thread_ = std::thread([&server, done = &metrics->done_] {
    server.listen_after_bind();
    done->store(true, std::memory_order_release);
  });
  return metrics;
}

void MetricsServer::Stop() {
  if (!thread_.joinable()) return;
  // stop() does nothing until listen_after_bind has started: asked again until it has ended.
  while (!done_.load(std::memory_order_acquire)) {
    server_->stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  thread_.join();
}

MetricsServer::~MetricsServer() { Stop(); }

}  // namespace tensorshm
