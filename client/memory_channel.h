// The client's end of the memory channel (see ChannelRequest in the .proto): a second
// connection on the daemon's socket over which segment descriptors arrive.
#ifndef TENSORSHM_CLIENT_MEMORY_CHANNEL_H_
#define TENSORSHM_CLIENT_MEMORY_CHANNEL_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/base/mutex.h"
#include "common/base/unique_fd.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

// Thread-safe; requests go one at a time. Connects lazily, and again (bound to the new session)
// whenever the session it is asked for is not the one it is bound to. Every connection is checked
// for who serves it before anything is sent (ConnectToDaemon with `server_uid`): a refused
// server is PERMISSION_DENIED.
// True for an Exchange failure after the request was sent, with no answer: the daemon may have
// carried it out (and then stopped, or closed the connection). Other failures left the request
// unseen by any daemon.
bool SentWithoutAnswer(const absl::Status& status);

class MemoryChannel {
 public:
  MemoryChannel(std::string socket, std::optional<uint32_t> server_uid)
      : socket_(std::move(socket)), server_uid_(server_uid) {}
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
  absl::StatusOr<v1::ChannelResponse> Exchange(const std::string& session_token,
                                               v1::ChannelRequest& request, UniqueFd* fd)
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
  // Connects and binds to `session_token`. REQUIRES: not connected.
  absl::Status Open(const std::string& session_token) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseConnection() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends `request` and reads its response; a transport failure closes the connection.
  absl::StatusOr<v1::ChannelResponse> Call(v1::ChannelRequest& request, UniqueFd* fd)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string socket_;
  const std::optional<uint32_t> server_uid_;
  mutable Mutex mu_;
  UniqueFd fd_ ABSL_GUARDED_BY(mu_);
  std::string bound_token_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  int calls_without_spin_ ABSL_GUARDED_BY(mu_) = 0;  // after a look for a reply missed
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_MEMORY_CHANNEL_H_
