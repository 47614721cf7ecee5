#include "client/memory_channel.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <memory>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "client/cancel.h"
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
// The payload that marks a channel that could not be had (ChannelNotHad).
constexpr char kNotHad[] = "tensorshm.dev/memory-channel/not-had";

absl::Status NotHad(absl::Status status) {
  status.SetPayload(kNotHad, absl::Cord("1"));
  return status;
}

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
  Break(absl::UnavailableError("memory channel: closed by the client"));
}

void MemoryChannel::Break(const absl::Status& status) {
  if (!fd_.valid()) return;
  const uint64_t broken = connection_;
  if (reading_) {
    // The reader fails the requests in flight itself once the shutdown wakes it; the descriptor
    // is not closed under it (its number could be another's by the time it reads).
    shutdown(fd_.get(), SHUT_RDWR);
    while (reading_) answered_.Wait(&mu_);
    if (connection_ != broken || !fd_.valid()) return;
  }
  for (auto& [sequence, call] : outstanding_) {
    call->done = true;
    call->failure = status;
  }
  outstanding_.clear();
  fd_.reset();
  bound_token_.clear();
  answered_.SignalAll();
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
  if (!wake_.valid()) {
    const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake < 0) return ErrnoError("eventfd", where, errno);
    wake_.reset(wake);
  }
  fd_ = std::move(fd);
  ++connection_;
  if (absl::Status s =
          SendWithFd(fd_.get(), absl::string_view(kChannelHello, kChannelHelloBytes), -1,
                     /*nonblocking=*/false, where);
      !s.ok()) {
    CloseConnection();
    return ClosedBeforeBound(where, s);
  }
  // Bound from here on for the callers that come meanwhile: their requests follow the bind, which
  // the daemon answers first.
  bound_token_ = session_token;
  v1::ChannelRequest bind;
  bind.mutable_bind()->set_session_id(session_token);
  UniqueFd unexpected;  // closed here: a bind's answer brings none
  absl::StatusOr<v1::ChannelResponse> response =
      Call(bind, &unexpected, absl::ZeroDuration(), nullptr);
  // The request the caller wants sent was not: only the bind was, which is harmless.
  if (!response.ok()) return ClosedBeforeBound(where, response.status());
  if (response->code() != 0 || !response->has_bound()) {
    CloseConnection();
    return absl::Status(
        static_cast<absl::StatusCode>(response->code() != 0 ? response->code() : 13),
        absl::StrCat("memory channel: ", response->message()));
  }
  return absl::OkStatus();
}

namespace {

// The daemon answers a channel request in tens of microseconds. Looking for the reply that long,
// yielding the CPU between looks (on a small machine the daemon may be waiting for this very CPU),
// saves the caller a sleep and a wake-up, which cost about as much again on a virtual machine.
// Bounded: after kReplySpin the caller sleeps as before. Adaptive: a look that missed (a busy
// daemon, a crowded machine) is not tried again for the next kCallsAfterMiss calls, so that many
// clients of a busy daemon do not spend their CPU looking.
constexpr absl::Duration kReplySpin = absl::Microseconds(50);
constexpr int kCallsAfterMiss = 32;

// The longest a reader sleeps before it looks at the deadlines again (a request sent meanwhile
// may have an earlier one than those it slept for).
constexpr absl::Duration kLongestSleep = absl::Seconds(1);

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

// Frames `message` as the channel carries it.
template <typename Message>
std::string Frame(const Message& message) {
  std::string frame(kFrameHeaderBytes, '\0');
  message.AppendToString(&frame);
  EncodeFrameHeader(static_cast<uint32_t>(frame.size() - kFrameHeaderBytes), frame.data());
  return frame;
}

}  // namespace

absl::StatusOr<v1::ChannelResponse> MemoryChannel::Call(v1::ChannelRequest& request, UniqueFd* fd,
                                                        absl::Duration wait, CancelTicket* ticket) {
  const std::string& where = where_;
  const uint64_t sequence = next_sequence_++;
  request.set_sequence(sequence);
  if (absl::Status s = SendWithFd(fd_.get(), Frame(request), -1, /*nonblocking=*/false, where);
      !s.ok()) {
    // Unsent (or cut short, which the daemon refuses as a frame): the caller may send it again.
    Break(absl::UnavailableError(s.message()));
    return absl::UnavailableError(s.message());
  }
  auto mine = std::make_shared<Outstanding>();
  mine->prompt = wait == absl::ZeroDuration();
  mine->deadline = wait == absl::InfiniteDuration()
                       ? absl::InfiniteFuture()
                       : absl::Now() + wait + absl::Seconds(kIoTimeoutSeconds);
  outstanding_[sequence] = mine;
  if (ticket != nullptr) {
    ticket->sequence.store(sequence, std::memory_order_release);
    // A cancel that came before the sequence was known found nothing to cancel.
    if (ticket->asked.load(std::memory_order_acquire)) SendCancel(sequence);
  }
  while (!mine->done && !mine->cancelled) {
    if (reading_) {
      answered_.Wait(&mu_);
    } else {
      ReadOne();
    }
  }
  if (!mine->done) {
    // Cancelled: the caller stops waiting now; the answer, which may have crossed the cancel
    // (a grant the caller then settles), is dropped when it comes.
    mine->abandoned = true;
    absl::Status cancelled = absl::CancelledError("the wait was cancelled");
    cancelled.SetPayload(kSentWithoutAnswer, absl::Cord("1"));
    return cancelled;
  }
  if (!mine->failure.ok()) {
    // The daemon went away or broke the protocol: either way the channel is gone, and the
    // daemon may have carried the request out.
    absl::Status gone = absl::UnavailableError(mine->failure.message());
    gone.SetPayload(kSentWithoutAnswer, absl::Cord("1"));
    return gone;
  }
  *fd = std::move(mine->fd);
  return std::move(mine->response);
}

void MemoryChannel::ReadOne() {
  const std::string& where = where_;
  absl::Time deadline = absl::InfiniteFuture();
  bool prompt = false;
  for (const auto& [sequence, call] : outstanding_) {
    // An abandoned request's answer is read when it comes, but nothing waits for it.
    if (call->abandoned) continue;
    deadline = std::min(deadline, call->deadline);
    prompt = prompt || call->prompt;
  }
  bool spin = false;
  if (prompt && calls_without_spin_ > 0) {
    --calls_without_spin_;
  } else if (prompt) {
    spin = true;
  }
  const int socket = fd_.get();
  const int wake = wake_.get();
  reading_ = true;
  mu_.unlock();
  absl::Status status;
  std::string body;
  UniqueFd received;
  bool missed = false;
  bool readable = spin && AwaitReply(socket);
  missed = spin && !readable;
  if (!readable) {
    // What came is read even past the deadline (an answer may have waited in the socket while
    // no one read it); only a deadline passed with nothing to read is the daemon's silence.
    const absl::Duration left = std::max(absl::ZeroDuration(), deadline - absl::Now());
    pollfd wanted[2] = {{socket, POLLIN, 0}, {wake, POLLIN, 0}};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(
        absl::Ceil(std::min(left, kLongestSleep), absl::Milliseconds(1))));
    const int ready = poll(wanted, 2, ms);
    if (ready < 0 && errno != EINTR) status = ErrnoError("poll", where, errno);
    if (ready > 0 && wanted[1].revents != 0) {
      uint64_t count;
      (void)read(wake, &count, sizeof(count));  // a cancel: the callers look again
    }
    readable = ready > 0 && wanted[0].revents != 0;
    if (status.ok() && !readable && absl::Now() >= deadline) {
      status = absl::UnavailableError(
          absl::StrCat("memory channel ", where, ": the daemon did not answer within its time"));
    }
  }
  if (status.ok() && readable) status = ReceiveFrame(socket, &body, &received, where);
  mu_.lock();
  reading_ = false;
  answered_.SignalAll();  // the reader's turn is free
  if (missed) calls_without_spin_ = kCallsAfterMiss;
  if (status.ok() && !readable) return;  // nothing yet: the deadlines are looked at again
  v1::ChannelResponse response;
  if (status.ok() && !response.ParseFromString(body)) {
    status = absl::InternalError(
        absl::StrCat("memory channel ", where, ": the daemon sent a malformed response"));
  }
  auto it = status.ok() ? outstanding_.find(response.sequence()) : outstanding_.end();
  if (status.ok() && it == outstanding_.end()) {
    status =
        absl::InternalError(absl::StrCat("memory channel ", where, ": the daemon answered request ",
                                         response.sequence(), ", which is not in flight"));
  }
  if (!status.ok()) {
    Break(status);
    return;
  }
  std::shared_ptr<Outstanding> call = std::move(it->second);
  outstanding_.erase(it);
  if (call->abandoned) return;  // its caller gave up: the answer and its descriptor are dropped
  call->response = std::move(response);
  call->fd = std::move(received);
  call->done = true;
}

void MemoryChannel::Expect(const std::string& session_token, uint32_t micros) {
  MutexLock lock(&mu_);
  if (!fd_.valid() || bound_token_ != session_token) return;
  v1::ChannelRequest request;
  request.mutable_expect()->set_micros(micros);
  // A failed send shows again on the next Call, which deals with it.
  (void)SendWithFd(fd_.get(), Frame(request), -1, /*nonblocking=*/false, "memory channel");
}

void MemoryChannel::CancelRequest(CancelTicket& ticket) {
  ticket.asked.store(true, std::memory_order_release);
  MutexLock lock(&mu_);
  // Not sent yet: its Call looks at `asked` once it has sent it.
  const uint64_t sent = ticket.sequence.load(std::memory_order_acquire);
  if (sent != 0) SendCancel(sent);
}

void MemoryChannel::SendCancel(uint64_t sequence) {
  // Answered already, or the connection is gone (and the request failed with it).
  auto it = outstanding_.find(sequence);
  if (!fd_.valid() || it == outstanding_.end() || it->second->done || it->second->cancelled) {
    return;
  }
  // Its caller returns now, whether it reads the connection (woken) or waits for whoever does.
  it->second->cancelled = true;
  answered_.SignalAll();
  if (reading_) {
    const uint64_t one = 1;
    (void)write(wake_.get(), &one, sizeof(one));
  }
  v1::ChannelRequest request;
  request.mutable_cancel()->set_sequence(sequence);
  // A failed send breaks the connection for the reader, which fails the request.
  (void)SendWithFd(fd_.get(), Frame(request), -1, /*nonblocking=*/false, "memory channel");
}

bool SentWithoutAnswer(const absl::Status& status) {
  return status.GetPayload(kSentWithoutAnswer).has_value();
}

bool ChannelNotHad(const absl::Status& status) { return status.GetPayload(kNotHad).has_value(); }

absl::StatusOr<v1::ChannelResponse> MemoryChannel::Exchange(const std::string& session_token,
                                                            v1::ChannelRequest& request,
                                                            UniqueFd* fd, absl::Duration wait,
                                                            CancelState* cancel) {
  fd->reset();
  // Registered before the lock is taken (a Cancel takes it while it holds its own).
  CancelTicket ticket;
  ScopedWait cancellable(cancel,
                         CancelState::Wait{.call = [this, &ticket] { CancelRequest(ticket); }});
  if (!cancellable.registered()) return absl::CancelledError("the wait was cancelled");
  MutexLock lock(&mu_);
  // A connection that broke (the daemon restarted) is made again once, bound to the session
  // the caller has now.
  for (int attempt = 0; attempt < 2; ++attempt) {
    while (fd_.valid() && bound_token_ != session_token) CloseConnection();
    if (!fd_.valid()) {
      // Only a channel that cannot be had now; a refusal (a server of another uid, a bind the
      // daemon refused) is the caller's answer.
      if (absl::Status s = Open(session_token); !s.ok()) {
        return absl::IsUnavailable(s) ? NotHad(s) : s;
      }
    }
    absl::StatusOr<v1::ChannelResponse> response =
        Call(request, fd, wait, cancel != nullptr ? &ticket : nullptr);
    if (!response.ok()) {
      // Sent again only if the daemon cannot have seen it: a request it may have carried out
      // (a publish) must not be carried out twice.
      if (SentWithoutAnswer(response.status())) return response.status();
      if (attempt == 0) continue;
      return NotHad(response.status());
    }
    if (response->code() != 0) {
      fd->reset();
      return absl::Status(static_cast<absl::StatusCode>(response->code()), response->message());
    }
    return response;
  }
  return NotHad(absl::UnavailableError("memory channel: the daemon closed the connection twice"));
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
