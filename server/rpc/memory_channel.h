// The daemon's side of the memory channel: the connections clients open next to their gRPC
// connection to receive segment descriptors (see ChannelRequest in the .proto). One thread
// serves them all with epoll; requests are answered in order, one response each, except those
// the handler answers later (a create that waits), through the connection's ChannelLink.
#ifndef TENSORSHM_SERVER_RPC_MEMORY_CHANNEL_H_
#define TENSORSHM_SERVER_RPC_MEMORY_CHANNEL_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/event_loop.h"
#include "common/base/mutex.h"
#include "common/base/unique_fd.h"
#include "common/shm/channel_frame.h"
#include "server/core/access.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

// A request answered later (ChannelReply::deferred), as its connection holds it until then: the
// connection's close, or a ChannelCancel naming it, gives up on it.
class DeferredCall {
 public:
  virtual ~DeferredCall() = default;
  // The client gave up (or is gone): the call is answered CANCELLED, unless answered already.
  // Thread-safe; called with no lock of the channel's held.
  virtual void GiveUp() = 0;
};

// How a connection is written to, by the serving thread and by whoever answers a deferred
// request (the thread that freed the memory, the grower): one reply at a time, none once the
// connection is closed. It holds the connection's deferred calls until they are answered.
// Thread-safe; shared by the connection and its deferred calls, which may outlive it.
class ChannelLink {
 public:
  ChannelLink(int fd, std::string who) : fd_(fd), who_(std::move(who)) {}
  ChannelLink(const ChannelLink&) = delete;
  ChannelLink& operator=(const ChannelLink&) = delete;

  // Sends `response` with descriptor `fd` (-1: none) as one frame, without blocking: a client
  // that does not read its answers loses its connection (shut down here, closed by the serving
  // thread). Whether it was sent: false once the connection is closed (nothing sent) or broken.
  bool Send(const v1::ChannelResponse& response, int fd) ABSL_LOCKS_EXCLUDED(mu_);
  // Holds `call`, request `sequence`'s, until Drop; false (not held) once the connection is
  // closed, or if a call of that sequence is held already.
  bool Hold(uint64_t sequence, std::shared_ptr<DeferredCall> call) ABSL_LOCKS_EXCLUDED(mu_);
  // The call held for request `sequence`, or null.
  std::shared_ptr<DeferredCall> Find(uint64_t sequence) const ABSL_LOCKS_EXCLUDED(mu_);
  void Drop(uint64_t sequence) ABSL_LOCKS_EXCLUDED(mu_);
  // The serving thread, before it closes the descriptor: no Send writes to it afterwards, and
  // the calls still held are returned (to be given up on).
  std::vector<std::shared_ptr<DeferredCall>> Close() ABSL_LOCKS_EXCLUDED(mu_);

  const std::string& who() const { return who_; }

 private:
  mutable Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_);  // -1 once closed
  std::map<uint64_t, std::shared_ptr<DeferredCall>> held_ ABSL_GUARDED_BY(mu_);
  const std::string who_;  // "of pid P (uid U)", for messages
};

// One memory channel connection as the request handler sees it.
struct ChannelConnection {
  PeerCredentials peer;               // from SO_PEERCRED when it was accepted
  std::string session_token;          // the session it is bound to; empty until a bind succeeds
  std::shared_ptr<ChannelLink> link;  // for answers sent later (ChannelReply::deferred)
};

// What the handler answers: the response, and a descriptor to send with it (or none), which the
// server closes once sent. `deferred`: nothing is sent now (a request answered later, through
// the connection's link, or one answered by nothing: ChannelCancel).
struct ChannelReply {
  v1::ChannelResponse response;
  UniqueFd fd;
  bool deferred = false;
};

// Thread-safe.
class ChannelServer {
 public:
  using Handler = std::function<ChannelReply(ChannelConnection&, const v1::ChannelRequest&)>;

  // Starts the serving thread. Errors name the call that failed.
  static absl::StatusOr<std::unique_ptr<ChannelServer>> Start(Handler handler);
  ~ChannelServer();  // Stop()s
  ChannelServer(const ChannelServer&) = delete;
  ChannelServer& operator=(const ChannelServer&) = delete;

  // Serves connection `fd` (non-blocking; its hello already read).
  void Add(UniqueFd fd, const PeerCredentials& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // Closes every connection and joins the thread; idempotent. The handler is not called after.
  void Stop();

  size_t connection_count() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Connection {
    UniqueFd fd;
    ChannelConnection state;
    FrameReader input;  // bytes received, not yet a whole frame
  };
  ChannelServer(Handler handler, std::unique_ptr<EventLoop> loop)
      : handler_(std::move(handler)), loop_(std::move(loop)) {}
  void Run();
  // Reads what `fd` has and answers every whole frame; false if the connection must go.
  bool Serve(int fd, Connection& connection);
  // Serving thread only: stops watching `fd` and closes it; its deferred calls are given up on.
  void Close(int fd) ABSL_LOCKS_EXCLUDED(mu_);

  const Handler handler_;
  const std::unique_ptr<EventLoop> loop_;  // the serving thread's; Stop() stops it
  std::thread thread_;
  // The latest ChannelExpect (serving thread only): until when the thread looks for connection
  // expect_fd_'s next request rather than sleep; that request ends it.
  absl::Time expect_until_ = absl::InfinitePast();
  int expect_fd_ = -1;
  // After an expected request did not come within its look, this many ChannelExpects are
  // ignored (the channel thread sleeps as without them).
  static constexpr int kExpectsAfterMiss = 32;
  int expects_skipped_ = 0;
  mutable Mutex mu_;
  std::map<int, std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_MEMORY_CHANNEL_H_
