// Pool growth outside the service mutex: creates from many sessions at once, each of which may
// need a new segment, never make the pool exceed --host-pool, and the last ones are refused
// RESOURCE_EXHAUSTED with the exact free sizes. The pool holds what it says: the ends of segments
// too small for the next tensor are given back for new segments.
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/raw_session.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

TEST(PoolGrowthTest, ConcurrentCreatesThatGrowThePoolFillItExactly) {
  // Segments of 8 MiB at most: each holds two 3 MiB tensors and an end of 2 MiB too small for a
  // third, given back once the pool has no other room; 21 tensors fill 63 of the 64 MiB.
  constexpr int64_t kMiB = 1 << 20;
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("poolgrowth", {"--host-pool", "64Mi", "--segment-size", "8Mi"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  constexpr int kThreads = 12;
  std::vector<std::unique_ptr<RawSession>> sessions;
  for (int i = 0; i < kThreads; ++i) {
    sessions.push_back(std::make_unique<RawSession>(daemon->socket(), "pool_growth_test"));
    ASSERT_FALSE(sessions.back()->token().empty());
  }
  std::atomic<int> created{0}, refused{0}, wrong{0};
  std::mutex mu;
  std::string refusal, unexpected;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      // Until this session is refused: every create either fits or is refused as the pool is
      // full (nothing is freed meanwhile).
      while (true) {
        v1::CreateResponse response;
        grpc::Status status = sessions[i]->Create(3 * kMiB, &response);
        if (status.ok()) {
          ++created;
          continue;
        }
        std::lock_guard<std::mutex> lock(mu);
        if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          ++refused;
          refusal = status.error_message();
        } else {
          ++wrong;
          unexpected = status.error_message();
        }
        return;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0) << unexpected;
  EXPECT_EQ(created.load(), 21);
  EXPECT_EQ(refused.load(), kThreads);
  EXPECT_TRUE(absl::StartsWith(
      refusal, absl::StrCat("host pool: cannot allocate ", 3 * kMiB, " bytes (", 3 * kMiB,
                            " rounded to pages) for uid ", geteuid(), ": ", kMiB, " of ", 64 * kMiB,
                            " bytes free to it, largest free block ", kMiB, " bytes")))
      << refusal;
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon->socket(), "pool_growth_test"});
  ASSERT_TRUE(client.ok()) << client.status();
  tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_FALSE(stats->pools.empty());
  EXPECT_EQ(stats->pools[0].capacity_bytes, 64 * kMiB);
  EXPECT_EQ(stats->pools[0].used_bytes, 63 * kMiB);
  EXPECT_EQ(stats->pools[0].largest_free_bytes, kMiB);
  // The memory the segments take (their pages, the ends given back punched out) is never more
  // than the pool: 63 MiB of tensors and at most the 1 MiB left.
  int segments = 0;
  uint64_t pages_bytes = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (absl::StartsWith(entry.path().filename().string(), daemon->shm_prefix() + ".cpu.")) {
      ++segments;
      struct stat st;
      ASSERT_EQ(stat(entry.path().c_str(), &st), 0);
      EXPECT_LE(std::filesystem::file_size(entry.path()), static_cast<uintmax_t>(8 * kMiB));
      pages_bytes += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  EXPECT_EQ(segments, stats->pools[0].segments);
  EXPECT_GE(pages_bytes, static_cast<uint64_t>(63 * kMiB));
  EXPECT_LE(pages_bytes, static_cast<uint64_t>(64 * kMiB));
}

constexpr int64_t kMiB = 1 << 20;

// The host pool's segment count, as Stat reports it; -1 if Stat fails.
int64_t Segments(Client& client) {
  tensorshm::StatusOr<ServerStats> stats = client.Stat();
  if (!stats.ok() || stats->pools.empty()) return -1;
  return stats->pools[0].segments;
}

// Polls until the host pool has `segments` segments, for at most 30 s (a bound, not a timing).
bool WaitForSegments(Client& client, int64_t segments) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    if (Segments(client) == segments) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return Segments(client) == segments;
}

tensorshm::StatusOr<WritableTensor> CreateBytes(Client& client, int64_t bytes) {
  return client.Create(TensorSpec{{kDLUInt, 8, 1}, {bytes}});
}

// A create that leaves less than half a segment free in its uid's segments makes the daemon grow
// the pool by one segment in the background: the segment appears with no further create, and
// the next create finds room in it.
TEST(PoolGrowthTest, ACreateThatLeavesLessThanHalfASegmentFreeGrowsThePoolAhead) {
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("growahead", {"--host-pool", "64Mi", "--segment-size", "4Mi"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon->socket(), "pool_growth_test"});
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_EQ(Segments(**client), 1);
  // 1 MiB leaves 3 MiB free: no growth. 2 MiB more leave 1 MiB: one segment ahead.
  tensorshm::StatusOr<WritableTensor> small = CreateBytes(**client, kMiB);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(Segments(**client), 1);
  tensorshm::StatusOr<WritableTensor> more = CreateBytes(**client, 2 * kMiB);
  ASSERT_TRUE(more.ok()) << more.status();
  ASSERT_TRUE(WaitForSegments(**client, 2)) << Segments(**client) << " segments";
  // The grown segment takes the next create; it leaves 1 MiB there, so one more grows ahead.
  tensorshm::StatusOr<WritableTensor> next = CreateBytes(**client, 3 * kMiB);
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE(WaitForSegments(**client, 3)) << Segments(**client) << " segments";
  tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->pools[0].used_bytes, 6 * kMiB);
}

// Growth ahead never takes the pool's last segment of capacity: in a pool of two segments the
// second is made only by the create that needs it (over gRPC: the memory channel's thread makes
// no segment), and the pool never holds more than --host-pool.
TEST(PoolGrowthTest, GrowthAheadLeavesTheLastSegmentToTheCreateThatNeedsIt) {
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("growlast", {"--host-pool", "8Mi", "--segment-size", "4Mi"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon->socket(), "pool_growth_test"});
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<WritableTensor> held;
  for (int i = 0; i < 2; ++i) {
    tensorshm::StatusOr<WritableTensor> w = CreateBytes(**client, 3 * kMiB);
    ASSERT_TRUE(w.ok()) << i << ": " << w.status();
    held.push_back(*std::move(w));
    EXPECT_EQ(Segments(**client), i + 1);
  }
  tensorshm::StatusOr<WritableTensor> refused = CreateBytes(**client, 3 * kMiB);
  EXPECT_EQ(refused.status().code(), tensorshm::StatusCode::kResourceExhausted) << refused.status();
  tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->pools[0].segments, 2);
  EXPECT_EQ(stats->pools[0].used_bytes, 6 * kMiB);
}

}  // namespace
}  // namespace tensorshm::testing
