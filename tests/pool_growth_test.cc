// Pool growth outside the service mutex: creates from many sessions at once, each of which may
// need a new segment, never make the pool exceed --host-pool, and the last ones are refused
// RESOURCE_EXHAUSTED with the exact free sizes.
#include <atomic>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/raw_session.h"
#include "tests/test_daemon.h"

namespace tensorshm::testing {
namespace {

TEST(PoolGrowthTest, ConcurrentCreatesThatGrowThePoolFillItExactly) {
  // 8 segments of 8 MiB at most; each holds two 3 MiB tensors and 2 MiB nobody can use.
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
  EXPECT_EQ(created.load(), 16);
  EXPECT_EQ(refused.load(), kThreads);
  EXPECT_TRUE(absl::StartsWith(
      refusal,
      absl::StrCat("host pool: cannot allocate ", 3 * kMiB, " bytes (", 3 * kMiB,
                   " rounded to pages) for uid ", geteuid(), ": ", 16 * kMiB, " of ", 64 * kMiB,
                   " bytes free to it, largest free block ", 2 * kMiB, " bytes")))
      << refusal;
  absl::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon->socket(), "pool_growth_test"});
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<ServerStats> stats = (*client)->Stat();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_FALSE(stats->pools.empty());
  EXPECT_EQ(stats->pools[0].capacity_bytes, 64 * kMiB);
  EXPECT_EQ(stats->pools[0].used_bytes, 48 * kMiB);
  // Eight segments of 8 MiB: a ninth was never made.
  int segments = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (absl::StartsWith(entry.path().filename().string(), daemon->shm_prefix() + ".cpu.")) {
      ++segments;
      EXPECT_EQ(std::filesystem::file_size(entry.path()), static_cast<uintmax_t>(8 * kMiB));
    }
  }
  EXPECT_EQ(segments, 8);
}

}  // namespace
}  // namespace tensorshm::testing
