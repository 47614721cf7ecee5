#include "server/rpc/memory_channel.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/sys_error.h"
#include "common/shm/channel_frame.h"
#include "server/ops/log.h"

namespace tensorshm {

absl::StatusOr<std::unique_ptr<ChannelServer>> ChannelServer::Start(Handler handler) {
  absl::StatusOr<std::unique_ptr<EventLoop>> loop = EventLoop::Create("memory channel");
  if (!loop.ok()) return loop.status();
  std::unique_ptr<ChannelServer> server(new ChannelServer(std::move(handler), *std::move(loop)));
  server->thread_ = std::thread(&ChannelServer::Run, server.get());
  return server;
}

bool ChannelLink::Send(const v1::ChannelResponse& response, int fd) {
  std::string frame(kFrameHeaderBytes, '\0');
  response.AppendToString(&frame);
  EncodeFrameHeader(static_cast<uint32_t>(frame.size() - kFrameHeaderBytes), frame.data());
  MutexLock lock(&mu_);
  if (fd_ < 0) return false;
  absl::Status sent = SendWithFd(fd_, frame, fd, /*nonblocking=*/true, who_);
  if (sent.ok()) return true;
  TSM_LOG(kWarning) << sent.message();
  // The serving thread hears the hang-up and closes the connection.
  shutdown(fd_, SHUT_RDWR);
  return false;
}

bool ChannelLink::Hold(uint64_t sequence, std::shared_ptr<DeferredCall> call) {
  MutexLock lock(&mu_);
  if (fd_ < 0) return false;
  return held_.emplace(sequence, std::move(call)).second;
}

std::shared_ptr<DeferredCall> ChannelLink::Find(uint64_t sequence) const {
  MutexLock lock(&mu_);
  auto it = held_.find(sequence);
  return it == held_.end() ? nullptr : it->second;
}

void ChannelLink::Drop(uint64_t sequence) {
  std::shared_ptr<DeferredCall> dropped;  // freed once the lock is released
  MutexLock lock(&mu_);
  auto it = held_.find(sequence);
  if (it == held_.end()) return;
  dropped = std::move(it->second);
  held_.erase(it);
}

std::vector<std::shared_ptr<DeferredCall>> ChannelLink::Close() {
  MutexLock lock(&mu_);
  fd_ = -1;
  std::vector<std::shared_ptr<DeferredCall>> held;
  for (auto& [sequence, call] : held_) held.push_back(call);
  return held;
}

ChannelServer::~ChannelServer() { Stop(); }

void ChannelServer::Add(UniqueFd accepted, const PeerCredentials& peer) {
  const int fd = accepted.get();
  Connection* added;
  {
    MutexLock lock(&mu_);
    auto connection = std::make_unique<Connection>();
    connection->fd = std::move(accepted);
    connection->state.peer = peer;
    connection->state.link = std::make_shared<ChannelLink>(
        fd, absl::StrCat("memory channel of pid ", peer.pid, " (uid ", peer.uid, ")"));
    added = connection.get();
    connections_[fd] = std::move(connection);
  }
  // The connection stays where it is until the serving thread closes it (or Stop()).
  absl::Status watched =
      loop_->Watch(fd, EPOLLIN | EPOLLRDHUP, [this, fd, added](uint32_t /*events*/) {
        if (!Serve(fd, *added)) Close(fd);
      });
  if (!watched.ok()) {
    TSM_LOG(kWarning) << "memory channel of pid " << peer.pid << ": " << watched.message();
    MutexLock lock(&mu_);
    connections_.erase(fd);
  }
}

size_t ChannelServer::connection_count() const {
  MutexLock lock(&mu_);
  return connections_.size();
}

void ChannelServer::Stop() {
  if (!thread_.joinable()) return;
  loop_->Stop();
  thread_.join();
  std::vector<std::shared_ptr<DeferredCall>> held;
  {
    MutexLock lock(&mu_);
    for (auto& [fd, connection] : connections_) {
      for (std::shared_ptr<DeferredCall>& call : connection->state.link->Close()) {
        held.push_back(std::move(call));
      }
    }
    connections_.clear();  // closes them
  }
  for (const std::shared_ptr<DeferredCall>& call : held) call->GiveUp();
}

void ChannelServer::Close(int fd) {
  loop_->Unwatch(fd);
  std::unique_ptr<Connection> closed;  // closed (and freed) once the lock is released
  std::vector<std::shared_ptr<DeferredCall>> held;
  {
    MutexLock lock(&mu_);
    auto it = connections_.find(fd);
    if (it == connections_.end()) return;
    closed = std::move(it->second);
    connections_.erase(it);
    // No deferred answer writes to the descriptor from here on.
    held = closed->state.link->Close();
  }
  // The client is gone: what it still waits for is given up on (a create that waits for memory
  // leaves its queue; one answered meanwhile gives its buffers back, since no one took them).
  for (const std::shared_ptr<DeferredCall>& call : held) call->GiveUp();
}

void ChannelServer::Run() {
  // After serving a request, look for the next for a little while before sleeping: a producer's
  // next request (a put's publish after its create, a delete after a put) usually comes within
  // tens of microseconds, and finding it awake spares the sender a wake-up of this thread, which
  // costs it more than the request itself on a virtual machine. Yields between looks; idle, the
  // thread sleeps in epoll_wait as before. A client filling a buffer asks for a longer look
  // (ChannelExpect) before its publish.
  constexpr absl::Duration kLinger = absl::Microseconds(50);
  absl::Time linger_until = absl::InfinitePast();
  while (!loop_->stopped()) {
    // Each Poll() serves what came (Serve) before it returns.
    absl::StatusOr<int> n = 0;
    while (true) {
      n = loop_->Poll(0);
      if (!n.ok() || *n != 0 || absl::Now() >= linger_until) break;
      sched_yield();
    }
    if (n.ok() && *n == 0 && expect_fd_ >= 0) {
      // The expected request did not come in time (a slow fill, a crowded machine, where the
      // look only takes CPU from the others): the next expectations are not looked for.
      expect_fd_ = -1;
      expect_until_ = absl::InfinitePast();
      expects_skipped_ = kExpectsAfterMiss;
    }
    if (n.ok() && *n == 0) n = loop_->Poll(-1);
    if (!n.ok()) {
      TSM_LOG(kError) << n.status().message();
      return;
    }
    linger_until = std::max(absl::Now() + kLinger, expect_until_);
  }
}

bool ChannelServer::Serve(int fd, Connection& connection) {
  const std::string& who = connection.state.link->who();
  char buffer[16 * 1024];
  bool closed = false;
  while (true) {
    // Plain recv: descriptors a client might attach are discarded by the kernel.
    const ssize_t got = recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (got > 0) {
      connection.input.Append(buffer, static_cast<size_t>(got));
      // Enough for a whole frame: answer what is there first (epoll tells again about the rest).
      if (connection.input.buffered() > kFrameHeaderBytes + kMaxChannelFrame) break;
      continue;
    }
    if (got == 0) closed = true;
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK) closed = true;
    break;
  }
  while (true) {
    absl::string_view body;
    uint32_t length = 0;
    const FrameReader::Result next = connection.input.Next(&body, &length);
    if (next == FrameReader::Result::kNeedMore) break;
    if (next == FrameReader::Result::kTooLarge) {
      TSM_LOG(kWarning) << who << ": frame of " << length << " bytes (at most " << kMaxChannelFrame
                        << "); closed";
      return false;
    }
    v1::ChannelRequest request;
    if (!request.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
      TSM_LOG(kWarning) << who << ": a frame that is no ChannelRequest; "
                        << "closed";
      return false;
    }
    if (fd == expect_fd_) {  // the request it expected
      expect_until_ = absl::InfinitePast();
      expect_fd_ = -1;
    }
    if (request.kind_case() == v1::ChannelRequest::kExpect) {
      // Bounded, so that a client cannot keep this thread looking for long with one message.
      constexpr absl::Duration kLongestExpect = absl::Milliseconds(1);
      if (expects_skipped_ > 0) {
        --expects_skipped_;
      } else if (!connection.state.session_token.empty()) {
        expect_until_ =
            absl::Now() + std::min(absl::Microseconds(request.expect().micros()), kLongestExpect);
        expect_fd_ = fd;
      }
      continue;  // answered by nothing
    }
    ChannelReply reply = handler_(connection.state, request);
    if (reply.deferred) continue;  // answered later, through the link (or by nothing)
    // The descriptor the reply brings is closed once sent (with `reply`).
    if (!connection.state.link->Send(reply.response, reply.fd.get())) return false;
  }
  return !closed;
}

}  // namespace tensorshm
