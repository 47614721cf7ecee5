// Pool growth never stalls other clients: while one client's create waits for a new pool segment
// that takes long to make (TENSORSHMD_TEST_GROWTH_DELAY_MS plays a slow posix_fallocate), another
// client's creates and publishes over the memory channel are answered. The growth runs neither on
// the memory channel's thread (which serves every client's channel) nor under the service's lock
// (which every create and publish takes). Real daemon, real clients.
#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int64_t kKiB = 1 << 10;
constexpr int64_t kMiB = 1 << 20;
// Long against what a create and a publish take, even on a loaded machine under a sanitizer.
constexpr absl::Duration kGrowthDelay = absl::Seconds(5);
constexpr char kGrowthLine[] = "TENSORSHMD_TEST_GROWTH_DELAY_MS: a pool growth sleeps";

int64_t Segments(Client& client) {
  tensorshm::StatusOr<ServerStats> stats = client.Stat();
  if (!stats.ok() || stats->pools.empty()) return -1;
  return stats->pools[0].segments;
}

tensorshm::StatusOr<WritableTensor> CreateBytes(Client& client, int64_t bytes) {
  return client.Create(TensorSpec{{kDLUInt, 8, 1}, {bytes}});
}

TEST(SlowPoolGrowthTest, ChannelPublishesOfOtherClientsAreAnsweredWhileAPoolGrows) {
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
      "slowgrowth", {"--host-pool", "64Mi", "--segment-size", "4Mi"},
      {absl::StrCat("TENSORSHMD_TEST_GROWTH_DELAY_MS=", absl::ToInt64Milliseconds(kGrowthDelay))});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  tensorshm::StatusOr<std::shared_ptr<Client>> quick =
      Client::Connect(ClientOptions{daemon->socket(), "slow_growth_quick"});
  ASSERT_TRUE(quick.ok()) << quick.status();
  tensorshm::StatusOr<std::shared_ptr<Client>> growing =
      Client::Connect(ClientOptions{daemon->socket(), "slow_growth_growing"});
  ASSERT_TRUE(growing.ok()) << growing.status();
  // The quick client's channel is bound, and its first segment mapped, before the growth.
  {
    tensorshm::StatusOr<WritableTensor> warm = CreateBytes(**quick, 64 * kKiB);
    ASSERT_TRUE(warm.ok()) << warm.status();
    ASSERT_TRUE((*quick)->Publish(*warm, "slow_growth/warm").ok());
  }
  ASSERT_EQ(Segments(**quick), 1);
  ASSERT_FALSE(absl::StrContains(daemon->process().Output(), kGrowthLine))
      << daemon->process().Output();

  // 4 MiB do not fit beside the 64 KiB in the first segment of 4 MiB: the pool must grow.
  std::atomic<bool> grown_create_done{false};
  tensorshm::Status grown_create;
  std::thread grower([&] {
    tensorshm::StatusOr<WritableTensor> big = CreateBytes(**growing, 4 * kMiB);
    grown_create = big.status();
    grown_create_done = true;
  });
  ASSERT_TRUE(daemon->process().WaitForOutput(kGrowthLine, absl::Seconds(30)))
      << daemon->process().Output();

  // Meanwhile the other client creates and publishes over its channel, as if nothing grew.
  const absl::Time start = absl::Now();
  for (int i = 0; i < 4; ++i) {
    tensorshm::StatusOr<WritableTensor> small = CreateBytes(**quick, 64 * kKiB);
    ASSERT_TRUE(small.ok()) << i << ": " << small.status();
    const tensorshm::Status published = (*quick)->Publish(*small, absl::StrCat("slow_growth/", i));
    ASSERT_TRUE(published.ok()) << i << ": " << published;
  }
  const absl::Duration took = absl::Now() - start;
  EXPECT_FALSE(grown_create_done.load())
      << "the other client's creates and publishes were answered only after the growing create ("
      << grown_create << "): they waited for the growth, or it was not slowed by " << kGrowthDelay;
  EXPECT_LT(took, kGrowthDelay) << "the other client's creates and publishes waited for the growth";

  grower.join();
  EXPECT_TRUE(grown_create.ok()) << grown_create;
  EXPECT_GE(Segments(**quick), 2);
  tensorshm::StatusOr<ServerStats> stats = (*quick)->Stat();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->names, 5);
}

}  // namespace
}  // namespace tensorshm::testing
