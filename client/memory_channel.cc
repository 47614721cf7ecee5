#include "client/memory_channel.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "client/daemon_connection.h"
#include "client/fork.h"
#include "common/base/sys_error.h"
#include "common/shm/channel_frame.h"

namespace tensorshm {
namespace {

// A daemon that neither answers nor closes the connection within this long is taken as gone.
constexpr int kIoTimeoutSeconds = 30;

// The payload that marks a failure after the request was sent (SentWithoutAnswer).
constexpr char kSentWithoutAnswer[] = "tensorshm.dev/memory-channel/sent-without-answer";

// UNAVAILABLE for a new connection that the daemon closed before it was bound (`cause`: the
// failed send or receive). A daemon that serves closes a connection unanswered when it refuses
// it at accept.
absl::Status ClosedBeforeBound(const std::string& where, const absl::Status& cause) {
  return absl::UnavailableError(absl::StrCat(
      "memory channel: tensorshmd at ", where,
      " closed the connection before answering its bind (it is stopping, or it refused the "
      "connection at accept: its log says why, e.g. past --uid-connections or the daemon's "
      "connection limit): ",
      cause.message()));
}

}  // namespace

MemoryChannel::~MemoryChannel() {
  MutexLock lock(&mu_);
  CloseConnection();
}

void MemoryChannel::CloseConnection() {
  fd_.reset();
  bound_token_.clear();
}

absl::Status MemoryChannel::Open(const std::string& session_token) {
  const std::string where = absl::StrCat("unix:", socket_);
  absl::StatusOr<UniqueFd> connected = ConnectToDaemon(socket_, server_uid_);
  if (!connected.ok()) {
    return absl::Status(connected.status().code(),
                        absl::StrCat("memory channel: ", connected.status().message()));
  }
  UniqueFd fd = *std::move(connected);
  timeval timeout{kIoTimeoutSeconds, 0};
  if (setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout)) != 0 ||
      setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout)) != 0) {
    return ErrnoError("setsockopt(SO_RCVTIMEO/SO_SNDTIMEO)", where, errno);
  }
  fd_ = std::move(fd);
  if (absl::Status s =
          SendWithFd(fd_.get(), absl::string_view(kChannelHello, kChannelHelloBytes), -1,
                     /*nonblocking=*/false, where);
      !s.ok()) {
    CloseConnection();
    return ClosedBeforeBound(where, s);
  }
  v1::ChannelRequest bind;
  bind.mutable_bind()->set_session_id(session_token);
  UniqueFd unexpected;  // closed here: a bind's answer brings none
  absl::StatusOr<v1::ChannelResponse> response = Call(bind, &unexpected);
  // The request the caller wants sent was not: only the bind was, which is harmless.
  if (!response.ok()) return ClosedBeforeBound(where, response.status());
  if (response->code() != 0 || !response->has_bound()) {
    CloseConnection();
    return absl::Status(
        static_cast<absl::StatusCode>(response->code() != 0 ? response->code() : 13),
        absl::StrCat("memory channel: ", response->message()));
  }
  bound_token_ = session_token;
  return absl::OkStatus();
}

namespace {

// The daemon answers a channel request in tens of microseconds. Looking for the reply that long,
// yielding the CPU between looks (on a small machine the daemon may be waiting for this very CPU),
// saves the caller a sleep and a wake-up, which cost about as much again on a virtual machine.
// Bounded: after kReplySpin the caller sleeps in recvmsg as before. Adaptive: a look that missed
// (a busy daemon, a crowded machine) is not tried again for the next kCallsAfterMiss calls, so
// that many clients of a busy daemon do not spend their CPU looking.
constexpr absl::Duration kReplySpin = absl::Microseconds(50);
constexpr int kCallsAfterMiss = 32;

// True if the reply came within kReplySpin.
bool AwaitReply(int socket) {
  const absl::Time give_up = absl::Now() + kReplySpin;
  pollfd readable{socket, POLLIN, 0};
  while (true) {
    if (poll(&readable, 1, 0) != 0) return true;
    if (absl::Now() >= give_up) return false;
    sched_yield();
  }
}

}  // namespace

absl::StatusOr<v1::ChannelResponse> MemoryChannel::Call(v1::ChannelRequest& request, UniqueFd* fd) {
  const std::string where = absl::StrCat("unix:", socket_);
  request.set_sequence(next_sequence_++);
  std::string frame(kFrameHeaderBytes, '\0');
  request.AppendToString(&frame);
  EncodeFrameHeader(static_cast<uint32_t>(frame.size() - kFrameHeaderBytes), frame.data());
  absl::Status status = SendWithFd(fd_.get(), frame, -1, /*nonblocking=*/false, where);
  const bool sent = status.ok();
  std::string body;
  if (status.ok()) {
    if (calls_without_spin_ > 0) {
      --calls_without_spin_;
    } else if (!AwaitReply(fd_.get())) {
      calls_without_spin_ = kCallsAfterMiss;
    }
    status = ReceiveFrame(fd_.get(), &body, fd, where);
  }
  v1::ChannelResponse response;
  if (status.ok() &&
      (!response.ParseFromString(body) || response.sequence() != request.sequence())) {
    status = absl::InternalError(
        absl::StrCat("memory channel ", where, ": the daemon sent a malformed response"));
  }
  if (!status.ok()) {
    fd->reset();
    CloseConnection();
    // The daemon went away or broke the protocol: either way the channel is gone.
    absl::Status gone = absl::UnavailableError(status.message());
    if (sent) gone.SetPayload(kSentWithoutAnswer, absl::Cord("1"));
    return gone;
  }
  return response;
}

void MemoryChannel::Expect(const std::string& session_token, uint32_t micros) {
  MutexLock lock(&mu_);
  if (!fd_.valid() || bound_token_ != session_token) return;
  v1::ChannelRequest request;
  request.mutable_expect()->set_micros(micros);
  std::string frame(kFrameHeaderBytes, '\0');
  request.AppendToString(&frame);
  EncodeFrameHeader(static_cast<uint32_t>(frame.size() - kFrameHeaderBytes), frame.data());
  // A failed send shows again on the next Call, which deals with it.
  (void)SendWithFd(fd_.get(), frame, -1, /*nonblocking=*/false, "memory channel");
}

bool SentWithoutAnswer(const absl::Status& status) {
  return status.GetPayload(kSentWithoutAnswer).has_value();
}

absl::StatusOr<v1::ChannelResponse> MemoryChannel::Exchange(const std::string& session_token,
                                                            v1::ChannelRequest& request,
                                                            UniqueFd* fd) {
  fd->reset();
  MutexLock lock(&mu_);
  // A connection that broke (the daemon restarted) is made again once, bound to the session
  // the caller has now.
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (fd_.valid() && bound_token_ != session_token) CloseConnection();
    if (!fd_.valid()) {
      if (absl::Status s = Open(session_token); !s.ok()) return s;
    }
    absl::StatusOr<v1::ChannelResponse> response = Call(request, fd);
    if (!response.ok()) {
      // Sent again only if the daemon cannot have seen it: a request it may have carried out
      // (a publish) must not be carried out twice.
      if (attempt == 0 && !SentWithoutAnswer(response.status())) continue;
      return response.status();
    }
    if (response->code() != 0) {
      fd->reset();
      return absl::Status(static_cast<absl::StatusCode>(response->code()), response->message());
    }
    return response;
  }
  return absl::UnavailableError("memory channel: the daemon closed the connection twice");
}

absl::StatusOr<v1::ChannelResponse> MemoryChannel::Exchange(const std::string& session_token,
                                                            v1::ChannelRequest& request, int* fd) {
  UniqueFd received;
  absl::StatusOr<v1::ChannelResponse> response = Exchange(session_token, request, &received);
  *fd = received.release();  // the caller's now
  return response;
}

absl::StatusOr<UniqueFd> MemoryChannel::RequestSegment(const std::string& session_token,
                                                       uint64_t segment_instance,
                                                       uint64_t segment_id, bool writable,
                                                       uint64_t* size, std::string* shm_name) {
  v1::ChannelRequest request;
  v1::SegmentRequest* want = request.mutable_segment();
  want->set_segment_id(segment_id);
  want->set_segment_instance(segment_instance);
  want->set_writable(writable);
  UniqueFd fd;
  absl::StatusOr<v1::ChannelResponse> response = Exchange(session_token, request, &fd);
  if (!response.ok()) {
    return absl::Status(response.status().code(),
                        absl::StrCat("segment ", segment_id, ": ", response.status().message()));
  }
  if (!fd.valid() || !response->has_segment() || response->segment().segment_id() != segment_id ||
      response->segment().segment_instance() != segment_instance ||
      response->segment().writable() != writable) {
    return absl::InternalError(
        absl::StrCat("memory channel: the daemon granted something else than segment ", segment_id,
                     " (", response->ShortDebugString(), ")"));
  }
  *size = response->segment().size();
  *shm_name = response->segment().shm_name();
  return fd;
}

absl::StatusOr<UniqueFd> MemoryChannel::RequestCudaSegment(const std::string& session_token,
                                                           int device_ordinal,
                                                           uint64_t segment_instance,
                                                           uint64_t segment_id, uint64_t* size,
                                                           uint64_t* granularity) {
  v1::ChannelRequest request;
  v1::SegmentRequest* want = request.mutable_segment();
  want->set_segment_id(segment_id);
  want->set_segment_instance(segment_instance);
  want->set_cuda(true);
  want->set_device_ordinal(device_ordinal);
  UniqueFd fd;
  absl::StatusOr<v1::ChannelResponse> response = Exchange(session_token, request, &fd);
  if (!response.ok()) {
    return absl::Status(response.status().code(), absl::StrCat("cuda segment ", segment_id, ": ",
                                                               response.status().message()));
  }
  const v1::SegmentGrant& grant = response->segment();
  if (!fd.valid() || !response->has_segment() || grant.segment_id() != segment_id ||
      grant.segment_instance() != segment_instance || grant.granularity() == 0 ||
      grant.size() == 0 || grant.size() % grant.granularity() != 0) {
    return absl::InternalError(
        absl::StrCat("memory channel: the daemon granted something else than cuda segment ",
                     segment_id, " (", response->ShortDebugString(), ")"));
  }
  *size = grant.size();
  *granularity = grant.granularity();
  return fd;
}

}  // namespace tensorshm
