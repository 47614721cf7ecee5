#include "server/listener.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>

#include "common/channel_frame.h"
#include "common/sys_error.h"
#include "server/log.h"

namespace tensorshm {
namespace {

constexpr char kHttp2Preface[] = "PRI * HTTP/2.0";

// What a connection's first bytes say it is.
enum class Kind { kUnknown, kGrpc, kChannel, kNeedMore };

Kind Sort(const char* bytes, size_t n) {
  const size_t grpc = std::min(n, sizeof(kHttp2Preface) - 1);
  const size_t channel = std::min(n, kChannelHelloBytes);
  const bool maybe_grpc = std::memcmp(bytes, kHttp2Preface, grpc) == 0;
  const bool maybe_channel = std::memcmp(bytes, kChannelHello, channel) == 0;
  if (maybe_channel && n >= kChannelHelloBytes) return Kind::kChannel;
  // Four bytes of the preface are enough: nothing else on this socket starts with "PRI ".
  if (maybe_grpc && n >= 4) return Kind::kGrpc;
  return maybe_grpc || maybe_channel ? Kind::kNeedMore : Kind::kUnknown;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Create(const std::string& path,
                                                                   mode_t mode) {
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError("--socket = \"" + path + "\": too long for a Unix socket");
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return ErrnoError("socket", path, errno);
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoError("bind", path, err);
  }
  // The mode is set before listen(): nobody can connect in between.
  if (chmod(path.c_str(), mode) != 0 || listen(fd, 512) != 0) {
    const int err = errno;
    close(fd);
    unlink(path.c_str());
    return ErrnoError("chmod/listen", path, err);
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    const int err = errno;
    close(fd);
    unlink(path.c_str());
    return ErrnoError("eventfd", path, err);
  }
  return std::unique_ptr<UnixListener>(new UnixListener(path, fd, wake));
}

UnixListener::~UnixListener() {
  Stop();
  close(fd_);
  close(wake_fd_);
  unlink(path_.c_str());
}

void UnixListener::Start(Handoff on_grpc, Handoff on_channel, absl::Duration sort_timeout) {
  thread_ = std::thread([this, on_grpc = std::move(on_grpc), on_channel = std::move(on_channel),
                         sort_timeout] { Run(on_grpc, on_channel, sort_timeout); });
}

void UnixListener::Run(const Handoff& on_grpc, const Handoff& on_channel,
                       absl::Duration sort_timeout) {
  const int epoll = epoll_create1(EPOLL_CLOEXEC);
  if (epoll < 0) {
    TSM_LOG(kError) << "epoll_create1 for " << path_ << ": " << std::strerror(errno);
    return;
  }
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.fd = fd_;
  int added = epoll_ctl(epoll, EPOLL_CTL_ADD, fd_, &event);
  event.data.fd = wake_fd_;
  if (added == 0) added = epoll_ctl(epoll, EPOLL_CTL_ADD, wake_fd_, &event);
  if (added != 0) {
    // Nothing could ever be accepted: a daemon that cannot serve anyone stops here.
    TSM_LOG(kError) << "epoll_ctl for " << path_ << ": " << std::strerror(errno);
    std::abort();
  }
  struct Pending {
    PeerCredentials peer;
    absl::Time deadline;
  };
  std::map<int, Pending> pending;  // accepted, not yet sorted
  auto drop = [&](int fd) {
    epoll_ctl(epoll, EPOLL_CTL_DEL, fd, nullptr);
    pending.erase(fd);
  };
  bool running = true;
  while (running) {
    int timeout_ms = -1;
    const absl::Time now = absl::Now();
    for (auto it = pending.begin(); it != pending.end();) {
      auto next = std::next(it);
      if (it->second.deadline <= now) {
        TSM_LOG(kWarning) << "connection from pid " << it->second.peer.pid << " (uid "
                          << it->second.peer.uid << ") sent no protocol hello in "
                          << absl::FormatDuration(sort_timeout) << "; closed";
        const int fd = it->first;
        drop(fd);
        close(fd);
      } else {
        const int64_t ms = absl::ToInt64Milliseconds(it->second.deadline - now) + 1;
        if (timeout_ms < 0 || ms < timeout_ms) timeout_ms = static_cast<int>(ms);
      }
      it = next;
    }
    epoll_event events[64];
    const int n = epoll_wait(epoll, events, 64, timeout_ms);
    if (n < 0 && errno != EINTR) {
      TSM_LOG(kError) << "epoll_wait on " << path_ << ": " << std::strerror(errno);
      break;
    }
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        running = false;
        break;
      }
      if (fd == fd_) {
        while (true) {
          const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
          if (conn < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno == EMFILE || errno == ENFILE) {
              TSM_LOG(kWarning) << "accept on " << path_ << ": " << std::strerror(errno);
              usleep(10000);
            }
            break;  // EAGAIN: all taken
          }
          absl::StatusOr<PeerCredentials> peer = ReadPeerCredentials(conn);
          if (!peer.ok()) {
            TSM_LOG(kWarning) << peer.status().message();
            close(conn);
            continue;
          }
          // Edge-triggered: a peer that trickles its hello byte by byte wakes the loop once
          // per arrival, not continuously.
          epoll_event watch{};
          watch.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
          watch.data.fd = conn;
          if (epoll_ctl(epoll, EPOLL_CTL_ADD, conn, &watch) != 0) {
            close(conn);
            continue;
          }
          pending[conn] = Pending{*peer, absl::Now() + sort_timeout};
        }
        continue;
      }
      auto it = pending.find(fd);
      if (it == pending.end()) continue;
      char bytes[kChannelHelloBytes];
      const ssize_t got = recv(fd, bytes, sizeof(bytes), MSG_PEEK | MSG_DONTWAIT);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      const PeerCredentials peer = it->second.peer;
      const Kind kind = got > 0 ? Sort(bytes, static_cast<size_t>(got)) : Kind::kUnknown;
      if (kind == Kind::kNeedMore && (events[i].events & (EPOLLRDHUP | EPOLLHUP)) == 0) continue;
      drop(fd);
      if (kind == Kind::kGrpc) {
        on_grpc(fd, peer);
      } else if (kind == Kind::kChannel && recv(fd, bytes, sizeof(bytes), MSG_DONTWAIT) ==
                                               static_cast<ssize_t>(sizeof(bytes))) {
        on_channel(fd, peer);
      } else {
        if (got > 0) {
          TSM_LOG(kWarning) << "connection from pid " << peer.pid << " (uid " << peer.uid
                            << ") speaks neither gRPC nor the memory channel; closed";
        }
        close(fd);
      }
    }
  }
  for (const auto& [fd, unused] : pending) close(fd);
  close(epoll);
}

void UnixListener::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    TSM_LOG(kWarning) << "waking the accept loop: " << std::strerror(errno);
  }
  thread_.join();
}

}  // namespace tensorshm
