// The daemon's side of the memory channel: the connections clients open next to their gRPC
// connection to receive segment descriptors (see ChannelRequest in the .proto). One thread
// serves them all with epoll; requests are answered in order, one response each.
#ifndef TENSORSHM_SERVER_RPC_MEMORY_CHANNEL_H_
#define TENSORSHM_SERVER_RPC_MEMORY_CHANNEL_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

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

// One memory channel connection as the request handler sees it.
struct ChannelConnection {
  PeerCredentials peer;       // from SO_PEERCRED when it was accepted
  std::string session_token;  // the session it is bound to; empty until a bind succeeds
};

// What the handler answers: the response, and a descriptor to send with it (or none), which the
// server closes once sent.
struct ChannelReply {
  v1::ChannelResponse response;
  UniqueFd fd;
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
  // Serving thread only: stops watching `fd` and closes it.
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
