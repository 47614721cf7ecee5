#include "server/rpc/listener.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/sys_error.h"
#include "common/shm/channel_frame.h"
#include "server/ops/log.h"

namespace tensorshm {
namespace {

constexpr char kHttp2Preface[] = "PRI * HTTP/2.0";

// What a connection's first bytes say it is.
enum class Kind { kUnknown, kGrpc, kChannel, kNeedMore };

// Connections accepted per wake-up of the loop, at most.
constexpr int kAcceptBatch = 256;
// How often every connection handed on is looked at (ConnectionTable::Sweep), for the gauge.
constexpr absl::Duration kGaugeSweepInterval = absl::Seconds(2);

// The log line for a connection of `peer` that `why` refused.
std::string RefusalLine(const PeerCredentials& peer, ConnectionRefusal why,
                        const ConnectionTable& connections) {
  const ConnectionLimits& limits = connections.limits();
  if (why == ConnectionRefusal::kUidLimit) {
    return absl::StrCat("connection from pid ", peer.pid, " refused at accept: uid ", peer.uid,
                        " has ", connections.count(peer.uid), " connections open, limit ",
                        limits.per_uid, " (--uid-connections)");
  }
  return absl::StrCat(
      "connection from pid ", peer.pid, " (uid ", peer.uid, ") refused at accept: the daemon has ",
      connections.total(), " connections open, limit ", limits.total,
      peer.uid == limits.owner
          ? ""
          : absl::StrCat(" (the last ", limits.owner_reserve, " kept for the daemon's own uid)"),
      " (from its open file limit; leaves descriptors for segments)");
}

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
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return ErrnoError("socket", path, errno);
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return ErrnoError("bind", path, errno);
  }
  // The mode is set before listen(): nobody can connect in between.
  if (chmod(path.c_str(), mode) != 0 || listen(fd.get(), 512) != 0) {
    const int err = errno;
    unlink(path.c_str());
    return ErrnoError("chmod/listen", path, err);
  }
  absl::StatusOr<std::unique_ptr<EventLoop>> loop = EventLoop::Create(path);
  if (!loop.ok()) {
    unlink(path.c_str());
    return loop.status();
  }
  return std::unique_ptr<UnixListener>(new UnixListener(path, std::move(fd), *std::move(loop)));
}

UnixListener::~UnixListener() {
  Stop();
  fd_.reset();
  unlink(path_.c_str());
}

void UnixListener::Start(Handoff on_grpc, Handoff on_channel, AcceptPolicy policy,
                         absl::Duration sort_timeout) {
  thread_ = std::thread([this, on_grpc = std::move(on_grpc), on_channel = std::move(on_channel),
                         policy = std::move(policy),
                         sort_timeout] { Run(on_grpc, on_channel, policy, sort_timeout); });
}

void UnixListener::Run(const Handoff& on_grpc, const Handoff& on_channel,
                       const AcceptPolicy& policy, absl::Duration sort_timeout) {
  EventLoop& loop = *loop_;
  struct Pending {
    UniqueFd fd;
    PeerCredentials peer;
    absl::Time deadline;
    bool admitted = true;
  };
  std::map<int, Pending> pending;  // accepted, not yet sorted
  ConnectionTable connections(policy.limits);
  RefusalLog refusals;
  // accept() failing (EMFILE) is logged like a refusal, under no uid: once, then counted.
  constexpr uid_t kNoUid = RefusalLog::kNoUid;
  auto count = [&](ConnectionRefusal why) {
    if (policy.metrics != nullptr) policy.metrics->CountConnectionRefused(why);
  };
  // Closes a connection the listener still holds.
  auto drop = [&](int fd) {
    loop.Unwatch(fd);
    auto it = pending.find(fd);
    UniqueFd conn = it != pending.end() ? std::move(it->second.fd) : UniqueFd();
    if (it != pending.end()) pending.erase(it);
    connections.Remove(fd);
    conn.reset();
  };
  // Hands a sorted connection on (`handoff` owns it from then on).
  auto hand_on = [&](int fd, const Handoff& handoff) {
    loop.Unwatch(fd);
    auto it = pending.find(fd);
    const PeerCredentials peer = it->second.peer;
    UniqueFd conn = std::move(it->second.fd);
    pending.erase(it);
    handoff(std::move(conn), peer);
  };
  // A report on an accepted connection: its first bytes, or its hang-up.
  auto sort = [&](int fd, uint32_t events) {
    auto it = pending.find(fd);
    if (it == pending.end()) return;
    const absl::Time now = absl::Now();
    char bytes[kChannelHelloBytes];
    const ssize_t got = recv(fd, bytes, sizeof(bytes), MSG_PEEK | MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
    const PeerCredentials peer = it->second.peer;
    const Kind kind = got > 0 ? Sort(bytes, static_cast<size_t>(got)) : Kind::kUnknown;
    if (kind == Kind::kNeedMore && (events & (EPOLLRDHUP | EPOLLHUP)) == 0) return;
    if (kind == Kind::kChannel && !it->second.admitted) {
      // A stranger's gRPC calls are answered PERMISSION_DENIED; a memory channel could only
      // be refused, and is closed here.
      refusals.Refused(peer.uid,
                       absl::StrCat("memory channel refused: ",
                                    policy.admit ? policy.admit(peer).message() : ""),
                       now);
      drop(fd);
      return;
    }
    if (kind == Kind::kGrpc) {
      // Handed on, still counted: ConnectionTable notices when its new owner closes it.
      hand_on(fd, on_grpc);
    } else if (kind == Kind::kChannel && recv(fd, bytes, sizeof(bytes), MSG_DONTWAIT) ==
                                             static_cast<ssize_t>(sizeof(bytes))) {
      hand_on(fd, on_channel);
    } else {
      if (got > 0) {
        refusals.Refused(peer.uid,
                         absl::StrCat("connection from pid ", peer.pid, " (uid ", peer.uid,
                                      ") speaks neither gRPC nor the memory channel; closed"),
                         now);
      }
      drop(fd);
    }
  };
  // A report on the listening socket: connections to accept.
  auto accept_batch = [&](uint32_t) {
    const absl::Time now = absl::Now();
    // A bounded batch per wake-up, so that a flood of connections does not keep the loop from
    // the ones already accepted (and their sort deadlines).
    for (int batch = 0; batch < kAcceptBatch; ++batch) {
      UniqueFd conn(accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!conn) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE) {
          refusals.Refused(kNoUid,
                           absl::StrCat("accept on ", path_, ": ", std::strerror(errno),
                                        " (connections wait in the backlog)"),
                           now);
          usleep(10000);
        }
        break;  // EAGAIN: all taken
      }
      const int fd = conn.get();
      absl::StatusOr<PeerCredentials> peer = ReadPeerCredentials(fd, {}, policy.needs_groups);
      if (!peer.ok()) {
        refusals.Refused(kNoUid, std::string(peer.status().message()), now);
        continue;
      }
      // The number is free again, so whatever held it before has closed: not counted.
      connections.Remove(fd);
      // Admission before resources: past its few connections that are held only to be told
      // why, a stranger's connection is closed before it is read, sorted or handed to anyone;
      // so is one past its uid's or the daemon's limit.
      absl::Status admitted = policy.admit ? policy.admit(*peer) : absl::OkStatus();
      if (const ConnectionRefusal why = connections.Check(peer->uid, admitted.ok(), now);
          why != ConnectionRefusal::kNone) {
        conn.reset();
        count(why);
        refusals.Refused(
            peer->uid,
            why == ConnectionRefusal::kNotAdmitted
                ? absl::StrCat("connection refused at accept: ", admitted.message(), " (past the ",
                               connections.limits().stranger_per_uid,
                               " connections a uid that is not admitted may hold to be told so, ",
                               connections.limits().strangers, " in all)")
                : RefusalLine(*peer, why, connections),
            now);
        continue;
      }
      if (absl::Status s = connections.Add(fd, peer->uid, admitted.ok()); !s.ok()) {
        refusals.Refused(peer->uid, std::string(s.message()), now);
        continue;
      }
      // Edge-triggered: a peer that trickles its hello byte by byte wakes the loop once per
      // arrival, not continuously.
      if (!loop.Watch(fd, EPOLLIN | EPOLLRDHUP | EPOLLET,
                      [&sort, fd](uint32_t events) { sort(fd, events); })
               .ok()) {
        connections.Remove(fd);
        continue;
      }
      pending[fd] = Pending{std::move(conn), *peer, now + sort_timeout, admitted.ok()};
    }
  };
  if (absl::Status watched = loop.Watch(fd_.get(), EPOLLIN, accept_batch); !watched.ok()) {
    // Nothing could ever be accepted: a daemon that cannot serve anyone stops here.
    TSM_LOG(kError) << watched.message();
    std::abort();
  }
  absl::Time next_sweep = absl::Now() + kGaugeSweepInterval;
  while (!loop.stopped()) {
    int timeout_ms = -1;
    const absl::Time now = absl::Now();
    auto wake_by = [&](absl::Time when) {
      const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(when - now) + 1);
      if (timeout_ms < 0 || ms < timeout_ms)
        timeout_ms = static_cast<int>(std::min<int64_t>(ms, 60000));
    };
    for (auto it = pending.begin(); it != pending.end();) {
      auto next = std::next(it);
      if (it->second.deadline <= now) {
        const PeerCredentials peer = it->second.peer;
        refusals.Refused(peer.uid,
                         absl::StrCat("connection from pid ", peer.pid, " (uid ", peer.uid,
                                      ") sent no protocol hello in ",
                                      absl::FormatDuration(sort_timeout), "; closed"),
                         now);
        drop(it->first);
      } else {
        wake_by(it->second.deadline);
      }
      it = next;
    }
    refusals.Flush(now);
    if (absl::Time flush = refusals.NextFlush(); flush != absl::InfiniteFuture()) wake_by(flush);
    // Connections handed on close without telling: a periodic look keeps the gauge true.
    if (now >= next_sweep) {
      connections.Sweep(now);
      next_sweep = now + kGaugeSweepInterval;
    }
    if (policy.metrics != nullptr) {
      policy.metrics->SetConnections(static_cast<int64_t>(connections.total()));
    }
    if (connections.total() > 0) wake_by(next_sweep);
    if (absl::StatusOr<int> polled = loop.Poll(timeout_ms); !polled.ok()) {
      TSM_LOG(kError) << polled.status().message();
      break;
    }
  }
  loop.Unwatch(fd_.get());
  for (auto& [fd, connection] : pending) loop.Unwatch(fd);
  pending.clear();  // closes them
  refusals.Flush(absl::InfiniteFuture());
}

void UnixListener::Stop() {
  if (!thread_.joinable()) return;
  loop_->Stop();
  thread_.join();
}

}  // namespace tensorshm
