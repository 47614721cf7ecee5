// The client's end of the memory channel (see ChannelRequest in the .proto): a second
// connection on the daemon's socket over which segment descriptors arrive.
#ifndef TENSORSHM_CLIENT_MEMORY_CHANNEL_H_
#define TENSORSHM_CLIENT_MEMORY_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "common/base/unique_fd.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

class CancelState;

// Thread-safe; several requests may be in flight at once, from any threads: each is answered by
// the response that echoes its sequence, in whatever order the daemon answers (a create that
// waits for memory is answered after the requests sent behind it). Whichever caller is waiting
// when no one reads the connection reads it, and hands each response to its caller. Connects
// lazily, and again (bound to the new session) whenever the session it is asked for is not the one
// it is bound to. Every connection is checked for who serves it before anything is sent
// (ConnectToDaemon with `server_uid`): a refused server is PERMISSION_DENIED. True for an Exchange
// failure after the request was sent, with no answer: the daemon may have carried it out (and then
// stopped, or closed the connection). Other failures left the request unseen by any daemon.
bool SentWithoutAnswer(const absl::Status& status);
// True for an Exchange failure that left the request unseen because the channel could not be
// had (no connection, one closed before its bind was answered, one that broke twice before the
// request went): the caller may make the RPC instead. A daemon's answer (UNAVAILABLE "tensorshmd is
// stopping" too, a refused bind) is never this.
bool ChannelNotHad(const absl::Status& status);

class MemoryChannel {
 public:
  MemoryChannel(std::string socket, std::optional<uint32_t> server_uid)
      : socket_(std::move(socket)), where_("unix:" + socket_), server_uid_(server_uid) {}
  ~MemoryChannel();
  MemoryChannel(const MemoryChannel&) = delete;
  MemoryChannel& operator=(const MemoryChannel&) = delete;

  // A descriptor of host segment `segment_id` made by instance `segment_instance`, as the
  // daemon grants it to session `session_token` (its Session stream's id): read-only, or
  // read-write; `*size` gets the segment's size. The daemon's refusal keeps its code
  // (PERMISSION_DENIED, FAILED_PRECONDITION, NOT_FOUND ...); no daemon is UNAVAILABLE.
  // Sends `request` for session `session_token` and returns the daemon's response, with the
  // descriptor that came with it in `*fd`, or none (what `*fd` held before is closed). A response
  // whose code is not OK becomes that status, with the daemon's message, and its descriptor is
  // closed. A broken connection is made again once, and the request sent again if it was not
  // sent before; no daemon is UNAVAILABLE (SentWithoutAnswer tells whether it may have seen the
  // request).
  // `wait`: how long the daemon may rightly hold the answer back (a create's wait for memory,
  // CreateRequest.wait_ms; infinite: for as long as it takes); past it and kIoTimeout, the daemon
  // is taken as gone. `cancel` (may be null): its Cancel sends ChannelCancel for the request, which
  // the daemon answers CANCELLED unless it answered already.
  absl::StatusOr<v1::ChannelResponse> Exchange(const std::string& session_token,
                                               v1::ChannelRequest& request, UniqueFd* fd,
                                               absl::Duration wait = absl::ZeroDuration(),
                                               CancelState* cancel = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same with the descriptor as a bare number the caller owns (-1: none), for callers that
  // keep it as one (tests).
  absl::StatusOr<v1::ChannelResponse> Exchange(const std::string& session_token,
                                               v1::ChannelRequest& request, int* fd)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Tells the daemon that this client's next request (a publish) comes in about `micros`
  // (ChannelExpect), so that its channel thread is awake for it. Sent only on a connection open
  // for `session_token`; never waits for an answer (there is none), and failures are ignored.
  void Expect(const std::string& session_token, uint32_t micros) ABSL_LOCKS_EXCLUDED(mu_);

  // A descriptor of host segment (segment_instance, segment_id), read-only or `writable`; its
  // size and POSIX shm name ("" for a memfd) as the daemon granted it.
  absl::StatusOr<UniqueFd> RequestSegment(const std::string& session_token,
                                          uint64_t segment_instance, uint64_t segment_id,
                                          bool writable, uint64_t* size, std::string* shm_name)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The descriptor of VMM segment (segment_instance, segment_id) of the daemon's CUDA device
  // `device_ordinal`; its size and allocation granularity as the daemon granted it.
  absl::StatusOr<UniqueFd> RequestCudaSegment(const std::string& session_token, int device_ordinal,
                                              uint64_t segment_instance, uint64_t segment_id,
                                              uint64_t* size, uint64_t* granularity)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // What a request's cancellation and its Call share. Atomics: the cancellation takes mu_ only
  // after it set `asked` (it runs under its CancelState's lock, which Call must not take).
  struct CancelTicket {
    std::atomic<uint64_t> sequence{0};  // once sent
    std::atomic<bool> asked{false};
  };
  // A request sent and not answered yet.
  struct Outstanding {
    absl::Time deadline;  // when the daemon is taken as gone if it has not answered
    bool prompt = false;  // answered at once (no wait): its reader looks for the answer first
    bool done = false;
    bool cancelled = false;  // its caller's WaitCanceller fired: the caller returns CANCELLED
    bool abandoned = false;  // its caller returned: the answer, when it comes, is dropped
    absl::Status failure;    // the connection's, when it broke first
    v1::ChannelResponse response;
    UniqueFd fd;
  };

  // Connects and binds to `session_token`. REQUIRES: not connected.
  absl::Status Open(const std::string& session_token) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the connection once no caller reads it (a reader is woken by a shutdown of the socket
  // and fails the requests in flight).
  void CloseConnection() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends `request` and waits for its response (reading the connection when no other caller
  // does); a transport failure closes the connection, failing every request in flight.
  // `ticket` (may be null): its sequence is set once sent, and a cancel asked before then is sent
  // as ChannelCancel at once.
  absl::StatusOr<v1::ChannelResponse> Call(v1::ChannelRequest& request, UniqueFd* fd,
                                           absl::Duration wait, CancelTicket* ticket)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The reader's turn (mu_ released while it reads): one frame, handed to its caller, or nothing
  // within a while (the deadlines are looked at again); past the earliest deadline of those in
  // flight, or on a transport failure, the connection breaks (Break).
  void ReadOne() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails every request in flight with `status` (sent, unanswered) and closes the connection.
  void Break(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A WaitCanceller fired for the request of `ticket`: sends ChannelCancel for it if it is in
  // flight (not sent yet: its Call sends it once it is).
  void CancelRequest(CancelTicket& ticket) ABSL_LOCKS_EXCLUDED(mu_);
  void SendCancel(uint64_t sequence) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string socket_;
  const std::string where_;  // "unix:<socket>", for messages
  const std::optional<uint32_t> server_uid_;
  mutable Mutex mu_;
  CondVar answered_;  // a response was handed to its caller, or the reader's turn is free
  UniqueFd fd_ ABSL_GUARDED_BY(mu_);
  std::string bound_token_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t connection_ ABSL_GUARDED_BY(mu_) = 0;  // counts the connections made
  std::map<uint64_t, std::shared_ptr<Outstanding>> outstanding_
      ABSL_GUARDED_BY(mu_);  // by sequence
  // Wakes the reader from its sleep (a cancel of a request it waits for); made with the first
  // connection.
  UniqueFd wake_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;        // a caller reads the connection (mu_ released)
  int calls_without_spin_ ABSL_GUARDED_BY(mu_) = 0;  // after a look for a reply missed
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_MEMORY_CHANNEL_H_
