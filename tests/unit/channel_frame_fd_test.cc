// ReceiveFrame's owning form (common/shm/channel_frame.h): the descriptor that comes with a frame
// lands in a UniqueFd, what the UniqueFd held before is closed, and a frame with more than one
// descriptor leaves none open.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "common/base/unique_fd.h"
#include "common/shm/channel_frame.h"
#include "gtest/gtest.h"

namespace tensorshm {
namespace {

struct Pipe {
  UniqueFd read;
  UniqueFd write;
};

Pipe MakePipe() {
  int ends[2];
  EXPECT_EQ(pipe2(ends, O_CLOEXEC), 0);
  return Pipe{UniqueFd(ends[0]), UniqueFd(ends[1])};
}

// True once every write end of `pipe` is closed: a read sees end-of-file at once.
bool WriteEndsClosed(const Pipe& pipe) {
  const int flags = fcntl(pipe.read.get(), F_GETFL);
  fcntl(pipe.read.get(), F_SETFL, flags | O_NONBLOCK);
  char byte;
  return read(pipe.read.get(), &byte, 1) == 0;
}

std::string Frame(const std::string& body) {
  std::string frame(kFrameHeaderBytes, '\0');
  EncodeFrameHeader(static_cast<uint32_t>(body.size()), frame.data());
  return frame + body;
}

class ChannelFrameFdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int pair[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    sender_.reset(pair[0]);
    receiver_.reset(pair[1]);
  }

  UniqueFd sender_;
  UniqueFd receiver_;
};

TEST_F(ChannelFrameFdTest, DescriptorArrivesInTheUniqueFdAndWhatItHeldIsClosed) {
  Pipe sent = MakePipe();
  Pipe held = MakePipe();
  ASSERT_TRUE(SendWithFd(sender_.get(), Frame("hello"), sent.write.get(), false, "test").ok());
  sent.write.reset();  // the one copy left is the one in flight

  UniqueFd fd = std::move(held.write);
  std::string body;
  ASSERT_TRUE(ReceiveFrame(receiver_.get(), &body, &fd, "test").ok());
  EXPECT_EQ(body, "hello");
  ASSERT_TRUE(fd.valid());
  EXPECT_TRUE(WriteEndsClosed(held));
  EXPECT_FALSE(WriteEndsClosed(sent));  // received, and held open by `fd`
  EXPECT_NE(fcntl(fd.get(), F_GETFD) & FD_CLOEXEC, 0);
  fd.reset();
  EXPECT_TRUE(WriteEndsClosed(sent));
}

TEST_F(ChannelFrameFdTest, FrameWithoutDescriptorLeavesNone) {
  ASSERT_TRUE(SendWithFd(sender_.get(), Frame("x"), -1, false, "test").ok());
  UniqueFd fd;
  std::string body;
  ASSERT_TRUE(ReceiveFrame(receiver_.get(), &body, &fd, "test").ok());
  EXPECT_EQ(body, "x");
  EXPECT_FALSE(fd.valid());
}

TEST_F(ChannelFrameFdTest, TwoDescriptorsWithOneFrameAreBothClosed) {
  Pipe first = MakePipe();
  Pipe second = MakePipe();
  const std::string frame = Frame("two");
  iovec iov{const_cast<char*>(frame.data()), frame.size()};
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  cmsghdr* header = CMSG_FIRSTHDR(&message);
  header->cmsg_level = SOL_SOCKET;
  header->cmsg_type = SCM_RIGHTS;
  header->cmsg_len = CMSG_LEN(2 * sizeof(int));
  const int fds[2] = {first.write.get(), second.write.get()};
  std::memcpy(CMSG_DATA(header), fds, sizeof(fds));
  ASSERT_EQ(sendmsg(sender_.get(), &message, 0), static_cast<ssize_t>(frame.size()));
  first.write.reset();
  second.write.reset();

  UniqueFd fd;
  std::string body;
  const absl::Status status = ReceiveFrame(receiver_.get(), &body, &fd, "test");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_FALSE(fd.valid());
  EXPECT_TRUE(WriteEndsClosed(first));
  EXPECT_TRUE(WriteEndsClosed(second));
}

TEST_F(ChannelFrameFdTest, PeerClosedIsUnavailableAndLeavesNone) {
  Pipe held = MakePipe();
  sender_.reset();
  UniqueFd fd = std::move(held.write);
  std::string body;
  const absl::Status status = ReceiveFrame(receiver_.get(), &body, &fd, "test");
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_FALSE(fd.valid());
  EXPECT_TRUE(WriteEndsClosed(held));
}

TEST_F(ChannelFrameFdTest, BareNumberFormHandsTheDescriptorToTheCaller) {
  Pipe sent = MakePipe();
  ASSERT_TRUE(SendWithFd(sender_.get(), Frame("n"), sent.write.get(), false, "test").ok());
  sent.write.reset();
  int fd = -1;
  std::string body;
  ASSERT_TRUE(ReceiveFrame(receiver_.get(), &body, &fd, "test").ok());
  ASSERT_GE(fd, 0);
  EXPECT_FALSE(WriteEndsClosed(sent));
  UniqueFd owned(fd);  // the caller's to close
  owned.reset();
  EXPECT_TRUE(WriteEndsClosed(sent));
}

}  // namespace
}  // namespace tensorshm
