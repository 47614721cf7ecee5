// WaitQueue: arrival order kept overall, per key and per session; removal from the middle; the
// earliest finite deadline, and what reports it.
#include "server/core/wait_queue.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tensorshm {
namespace {

struct Waiter {
  int id;
};

using Queue = WaitQueue<std::string, Waiter>;

std::vector<int> Ids(const std::vector<Waiter*>& waiters) {
  std::vector<int> ids;
  for (const Waiter* waiter : waiters) ids.push_back(waiter->id);
  return ids;
}

TEST(WaitQueueTest, KeepsArrivalOrderOverallPerKeyAndPerSession) {
  Waiter w[5] = {{0}, {1}, {2}, {3}, {4}};
  Queue queue;
  const absl::Time never = absl::InfiniteFuture();
  queue.Add(&w[0], "a", 1, never);
  queue.Add(&w[1], "b", 2, never);
  queue.Add(&w[2], "a", 2, never);
  queue.Add(&w[3], "b", 1, never);
  queue.Add(&w[4], "a", 1, never);
  EXPECT_EQ(queue.size(), 5u);
  EXPECT_EQ(Ids(queue.All()), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(Ids(queue.WithKey("a")), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(Ids(queue.OfSession(1)), (std::vector<int>{0, 3, 4}));
  EXPECT_EQ(queue.CountWithKey("b"), 2u);
  EXPECT_EQ(queue.CountOfSession(2), 2u);
  EXPECT_TRUE(queue.WithKey("c").empty());
  EXPECT_EQ(queue.CountOfSession(9), 0u);

  queue.Remove(&w[2]);  // from the middle of every index
  EXPECT_FALSE(queue.Contains(&w[2]));
  EXPECT_TRUE(queue.Contains(&w[3]));
  EXPECT_EQ(Ids(queue.All()), (std::vector<int>{0, 1, 3, 4}));
  EXPECT_EQ(Ids(queue.WithKey("a")), (std::vector<int>{0, 4}));
  EXPECT_EQ(Ids(queue.OfSession(2)), (std::vector<int>{1}));

  // Removing while walking a copy, as the service does when it fails a session's waiters.
  for (Waiter* waiter : queue.OfSession(1)) queue.Remove(waiter);
  EXPECT_EQ(Ids(queue.All()), (std::vector<int>{1}));
  EXPECT_EQ(queue.CountWithKey("a"), 0u);
  queue.Remove(&w[1]);
  EXPECT_TRUE(queue.empty());
  // Gone from every index: a waiter may come back under another key.
  EXPECT_FALSE(queue.Add(&w[1], "c", 3, never));
  EXPECT_EQ(Ids(queue.WithKey("c")), (std::vector<int>{1}));
}

TEST(WaitQueueTest, ReportsTheEarliestFiniteDeadline) {
  Waiter w[4] = {{0}, {1}, {2}, {3}};
  Queue queue;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(queue.NextDeadline(), absl::InfiniteFuture());
  EXPECT_EQ(queue.Expired(t0), nullptr);
  EXPECT_FALSE(queue.Add(&w[0], "a", 1, absl::InfiniteFuture()));
  EXPECT_EQ(queue.NextDeadline(), absl::InfiniteFuture());
  // Add says whether the new deadline is now the earliest (a sleeping timer must wake).
  EXPECT_TRUE(queue.Add(&w[1], "a", 1, t0 + absl::Seconds(10)));
  EXPECT_FALSE(queue.Add(&w[2], "a", 1, t0 + absl::Seconds(20)));
  EXPECT_TRUE(queue.Add(&w[3], "b", 2, t0 + absl::Seconds(5)));
  EXPECT_EQ(queue.NextDeadline(), t0 + absl::Seconds(5));

  EXPECT_EQ(queue.Expired(t0), nullptr);
  EXPECT_EQ(queue.Expired(t0 + absl::Seconds(5)), &w[3]);  // a deadline not after `now`
  queue.Remove(&w[3]);
  EXPECT_EQ(queue.Expired(t0 + absl::Seconds(9)), nullptr);
  EXPECT_EQ(queue.NextDeadline(), t0 + absl::Seconds(10));
  queue.Remove(&w[1]);
  queue.Remove(&w[2]);
  EXPECT_EQ(queue.NextDeadline(), absl::InfiniteFuture());
  // A waiter without a deadline never expires.
  EXPECT_EQ(queue.Expired(absl::InfiniteFuture()), nullptr);
  EXPECT_TRUE(queue.Contains(&w[0]));
}

}  // namespace
}  // namespace tensorshm
