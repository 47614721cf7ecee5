// EventLoop (common/base/event_loop.h): callbacks of watched descriptors, unwatching from a
// callback, waking and stopping from another thread, and Poll's timeout.
#include "common/base/event_loop.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/unique_fd.h"
#include "gtest/gtest.h"

namespace tensorshm {
namespace {

struct SocketPair {
  UniqueFd a;
  UniqueFd b;
};

SocketPair MakePair() {
  int fds[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), 0);
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

std::unique_ptr<EventLoop> MakeLoop() {
  absl::StatusOr<std::unique_ptr<EventLoop>> loop = EventLoop::Create("test loop");
  EXPECT_TRUE(loop.ok()) << loop.status();
  return loop.ok() ? *std::move(loop) : nullptr;
}

TEST(EventLoopTest, PollTimesOutWithNothingToReport) {
  std::unique_ptr<EventLoop> loop = MakeLoop();
  SocketPair pair = MakePair();
  int calls = 0;
  ASSERT_TRUE(loop->Watch(pair.a.get(), EPOLLIN, [&](uint32_t) { ++calls; }).ok());
  EXPECT_EQ(*loop->Poll(0), 0);
  const absl::Time start = absl::Now();
  EXPECT_EQ(*loop->Poll(50), 0);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(40));  // it did wait
  EXPECT_EQ(calls, 0);
}

TEST(EventLoopTest, CallsTheCallbackOfAReadyDescriptor) {
  std::unique_ptr<EventLoop> loop = MakeLoop();
  SocketPair pair = MakePair();
  std::vector<uint32_t> reports;
  ASSERT_TRUE(loop->Watch(pair.a.get(), EPOLLIN | EPOLLRDHUP,
                          [&](uint32_t events) {
                            reports.push_back(events);
                            char byte;
                            while (read(pair.a.get(), &byte, 1) == 1) {
                            }
                          })
                  .ok());
  ASSERT_EQ(write(pair.b.get(), "x", 1), 1);
  EXPECT_EQ(*loop->Poll(1000), 1);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_TRUE(reports[0] & EPOLLIN);
  EXPECT_EQ(*loop->Poll(0), 0);  // drained: level-triggered, nothing more
  pair.b.reset();                // the peer hangs up
  EXPECT_EQ(*loop->Poll(1000), 1);
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_TRUE(reports[1] & EPOLLRDHUP);
  // Watching it twice is refused.
  EXPECT_FALSE(loop->Watch(pair.a.get(), EPOLLIN, [](uint32_t) {}).ok());
}

TEST(EventLoopTest, EdgeTriggeredReportsEachArrivalOnce) {
  std::unique_ptr<EventLoop> loop = MakeLoop();
  SocketPair pair = MakePair();
  int calls = 0;
  ASSERT_TRUE(loop->Watch(pair.a.get(), EPOLLIN | EPOLLET, [&](uint32_t) { ++calls; }).ok());
  ASSERT_EQ(write(pair.b.get(), "x", 1), 1);
  EXPECT_EQ(*loop->Poll(1000), 1);
  EXPECT_EQ(*loop->Poll(0), 0);  // unread, but already reported
  ASSERT_EQ(write(pair.b.get(), "y", 1), 1);
  EXPECT_EQ(*loop->Poll(1000), 1);
  EXPECT_EQ(calls, 2);
}

TEST(EventLoopTest, UnwatchInsideACallbackSkipsTheRestOfTheBatch) {
  std::unique_ptr<EventLoop> loop = MakeLoop();
  SocketPair first = MakePair();
  SocketPair second = MakePair();
  int calls = 0;
  // Whichever callback runs first unwatches both descriptors (its own included): the other,
  // ready in the same batch, is not called.
  auto unwatch_both = [&](uint32_t) {
    ++calls;
    loop->Unwatch(first.a.get());
    loop->Unwatch(second.a.get());
  };
  ASSERT_TRUE(loop->Watch(first.a.get(), EPOLLIN, unwatch_both).ok());
  ASSERT_TRUE(loop->Watch(second.a.get(), EPOLLIN, unwatch_both).ok());
  ASSERT_EQ(write(first.b.get(), "x", 1), 1);
  ASSERT_EQ(write(second.b.get(), "x", 1), 1);
  EXPECT_EQ(*loop->Poll(1000), 2);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(*loop->Poll(0), 0);  // both still readable, neither watched
  loop->Unwatch(first.a.get());  // not watched: ignored
  // A descriptor unwatched may be watched again, with a new callback.
  int again = 0;
  ASSERT_TRUE(loop->Watch(first.a.get(), EPOLLIN, [&](uint32_t) { ++again; }).ok());
  EXPECT_EQ(*loop->Poll(1000), 1);
  EXPECT_EQ(again, 1);
  EXPECT_EQ(calls, 1);
}

TEST(EventLoopTest, WakeFromAnotherThreadEndsAWaitingPoll) {
  std::unique_ptr<EventLoop> loop = MakeLoop();
  std::thread waker([&] {
    absl::SleepFor(absl::Milliseconds(20));
    loop->Wake();
  });
  EXPECT_EQ(*loop->Poll(-1), 1);  // returns: would hang the test otherwise
  waker.join();
  EXPECT_FALSE(loop->stopped());
  EXPECT_EQ(*loop->Poll(0), 0);  // the wake-up was taken
}

TEST(EventLoopTest, StopFromAnotherThreadEndsTheLoopAndCallsNothingMore) {
  std::unique_ptr<EventLoop> loop = MakeLoop();
  SocketPair pair = MakePair();
  std::atomic<int> calls{0};
  ASSERT_TRUE(loop->Watch(pair.a.get(), EPOLLIN, [&](uint32_t) { ++calls; }).ok());
  std::thread runner([&] {
    while (!loop->stopped()) ASSERT_TRUE(loop->Poll(-1).ok());
  });
  absl::SleepFor(absl::Milliseconds(20));
  loop->Stop();
  runner.join();
  EXPECT_TRUE(loop->stopped());
  EXPECT_EQ(calls.load(), 0);
  ASSERT_EQ(write(pair.b.get(), "x", 1), 1);
  EXPECT_EQ(*loop->Poll(-1), 0);  // stopped: returns at once, calls nothing
  EXPECT_EQ(calls.load(), 0);
}

TEST(EventLoopTest, WatchFromAnotherThreadIsServedByThePollingThread) {
  std::unique_ptr<EventLoop> loop = MakeLoop();
  SocketPair pair = MakePair();
  std::atomic<int> calls{0};
  std::thread runner([&] {
    while (!loop->stopped()) ASSERT_TRUE(loop->Poll(-1).ok());
  });
  ASSERT_TRUE(loop->Watch(pair.a.get(), EPOLLIN | EPOLLET, [&](uint32_t) { ++calls; }).ok());
  ASSERT_EQ(write(pair.b.get(), "x", 1), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (calls.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  loop->Stop();
  runner.join();
  EXPECT_EQ(calls.load(), 1);
}

}  // namespace
}  // namespace tensorshm
