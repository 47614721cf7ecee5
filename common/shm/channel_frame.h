// The memory channel's framing (see ChannelRequest in proto/tensorshm/v1/tensorshm.proto): after
// the 8-byte hello, messages travel as a 4-byte little-endian length and the serialized message,
// with at most one file descriptor (SCM_RIGHTS) riding on a frame's first byte.
#ifndef TENSORSHM_COMMON_SHM_CHANNEL_FRAME_H_
#define TENSORSHM_COMMON_SHM_CHANNEL_FRAME_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/base/unique_fd.h"

namespace tensorshm {

// What a memory channel connection sends first. A gRPC connection starts with "PRI * HTTP/2.0".
inline constexpr char kChannelHello[] = "TSMCHAN1";
inline constexpr size_t kChannelHelloBytes = sizeof(kChannelHello) - 1;
static_assert(kChannelHelloBytes == 8);
// The largest frame body either side accepts.
inline constexpr uint32_t kMaxChannelFrame = 64 * 1024;
inline constexpr size_t kFrameHeaderBytes = 4;

// Splits a byte stream into frames as it arrives, however it was cut: Append what was received,
// then take the whole frames it completes with Next. The daemon's side of the memory channel
// reads with it. Not thread-safe.
class FrameReader {
 public:
  enum class Result {
    kFrame,     // `*body` is the next frame's body, valid until the next Append
    kNeedMore,  // no whole frame buffered
    kTooLarge,  // the next frame's header says more than kMaxChannelFrame (`*length`): the
                // stream cannot be read on; Next keeps answering this
  };
  void Append(const char* data, size_t size);
  Result Next(absl::string_view* body, uint32_t* length);
  // Bytes received and not yet taken as a frame.
  size_t buffered() const { return input_.size() - taken_; }

 private:
  std::string input_;
  size_t taken_ = 0;  // bytes of input_ already taken as frames
};

// Writes the frame header for a body of `length` bytes into `header`.
void EncodeFrameHeader(uint32_t length, char header[kFrameHeaderBytes]);
uint32_t DecodeFrameHeader(const char header[kFrameHeaderBytes]);

// Sends `bytes` on stream socket `socket` (all of it, retrying partial writes and EINTR), with
// `fd` attached to the first byte unless it is -1. With `nonblocking`, a socket that cannot take
// everything now is an error (UNAVAILABLE) instead of a wait. Errors name `peer`.
absl::Status SendWithFd(int socket, absl::string_view bytes, int fd, bool nonblocking,
                        absl::string_view peer);

// Receives one frame from blocking stream socket `socket` into `body`; `*fd` gets the
// descriptor that came with it (close-on-exec), or none (what it held before is closed).
// UNAVAILABLE if the peer closed the connection, INVALID_ARGUMENT for a frame over
// kMaxChannelFrame, or more than one descriptor (they are closed). On failure `*fd` holds none.
absl::Status ReceiveFrame(int socket, std::string* body, UniqueFd* fd, absl::string_view peer);
// The same with the descriptor as a bare number the caller owns (-1: none), for callers that
// keep it as one (tests).
absl::Status ReceiveFrame(int socket, std::string* body, int* fd, absl::string_view peer);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_SHM_CHANNEL_FRAME_H_
