#include "common/shm/channel_frame.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/sys_error.h"

namespace tensorshm {

void EncodeFrameHeader(uint32_t length, char header[kFrameHeaderBytes]) {
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) header[i] = static_cast<char>(length >> (8 * i));
}

void FrameReader::Append(const char* data, size_t size) {
  // Bodies handed out before are no longer used: their bytes go.
  input_.erase(0, taken_);
  taken_ = 0;
  input_.append(data, size);
}

FrameReader::Result FrameReader::Next(absl::string_view* body, uint32_t* length) {
  if (buffered() < kFrameHeaderBytes) return Result::kNeedMore;
  *length = DecodeFrameHeader(input_.data() + taken_);
  if (*length > kMaxChannelFrame) return Result::kTooLarge;
  if (buffered() - kFrameHeaderBytes < *length) return Result::kNeedMore;
  *body = absl::string_view(input_.data() + taken_ + kFrameHeaderBytes, *length);
  taken_ += kFrameHeaderBytes + *length;
  return Result::kFrame;
}

uint32_t DecodeFrameHeader(const char header[kFrameHeaderBytes]) {
  uint32_t length = 0;
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    length |= uint32_t{static_cast<unsigned char>(header[i])} << (8 * i);
  }
  return length;
}

absl::Status SendWithFd(int socket, absl::string_view bytes, int fd, bool nonblocking,
                        absl::string_view peer) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    iovec iov{const_cast<char*>(bytes.data()) + sent, bytes.size() - sent};
    msghdr message{};
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    if (sent == 0 && fd >= 0) {
      std::memset(control, 0, sizeof(control));
      message.msg_control = control;
      message.msg_controllen = sizeof(control);
      cmsghdr* header = CMSG_FIRSTHDR(&message);
      header->cmsg_level = SOL_SOCKET;
      header->cmsg_type = SCM_RIGHTS;
      header->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(header), &fd, sizeof(int));
    }
    const ssize_t n = sendmsg(socket, &message, MSG_NOSIGNAL | (nonblocking ? MSG_DONTWAIT : 0));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return absl::UnavailableError(
            absl::StrCat("memory channel ", peer, ": the peer reads nothing; dropped"));
      }
      return ErrnoError("sendmsg", absl::StrCat("memory channel ", peer), errno);
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

namespace {

// Reads exactly `length` bytes into `buffer`. Descriptors that arrive meanwhile are counted in
// `*received` (across calls for one frame); the first is kept in `*fd`, others are closed.
absl::Status ReadExactly(int socket, char* buffer, size_t length, UniqueFd* fd, int* received,
                         absl::string_view peer) {
  size_t got = 0;
  while (got < length) {
    iovec iov{buffer + got, length - got};
    msghdr message{};
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    // Room for more than one descriptor, so that extra ones are received (and closed), not left
    // in flight.
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(socket, &message, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("recvmsg", absl::StrCat("memory channel ", peer), errno);
    }
    if (n == 0) {
      return absl::UnavailableError(absl::StrCat("memory channel ", peer, ": closed by the peer"));
    }
    for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
         header = CMSG_NXTHDR(&message, header)) {
      if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int descriptor;
        std::memcpy(&descriptor, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
        UniqueFd arrived(descriptor);
        if (!fd->valid() && *received == 0) *fd = std::move(arrived);  // others close here
        ++*received;
      }
    }
    if (*received > 1 || (message.msg_flags & MSG_CTRUNC) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("memory channel ", peer, ": ", *received,
                                                     " descriptors with one frame; expected <= 1"));
    }
    got += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReceiveFrame(int socket, std::string* body, UniqueFd* fd, absl::string_view peer) {
  fd->reset();
  int received = 0;
  char header[kFrameHeaderBytes];
  absl::Status status = ReadExactly(socket, header, sizeof(header), fd, &received, peer);
  uint32_t length = 0;
  if (status.ok()) {
    length = DecodeFrameHeader(header);
    if (length > kMaxChannelFrame) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "memory channel ", peer, ": frame of ", length, " bytes; at most ", kMaxChannelFrame));
    }
  }
  if (status.ok()) {
    body->resize(length);
    status = ReadExactly(socket, body->data(), length, fd, &received, peer);
  }
  if (!status.ok()) fd->reset();
  return status;
}

absl::Status ReceiveFrame(int socket, std::string* body, int* fd, absl::string_view peer) {
  UniqueFd received;
  absl::Status status = ReceiveFrame(socket, body, &received, peer);
  *fd = received.release();  // the caller's now
  return status;
}

}  // namespace tensorshm
