// Lease pages written by a hostile client of an admitted uid (65534, --allow-uid), as issue 22
// found them: full pages of distinct ids no longer make the owner's Stat and List scan every slot
// of every page (Stat p50 under 10 ms and a List of 200 under 50 ms, in the best of three rounds:
// the scans made them 93 ms and 7.5 s; this 2-core VM measures 1-2.5 ms and 1-3.5 ms, the first
// above the 2 ms at times, with the attacker's 1,024 sessions beside the daemon); a page
// holding ids it could not acquire pins nothing, and what a uid's pages count stays within
// --uid-leases; a client's real fast path lease still keeps a deleted tensor's memory.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int kNobody = 65534;

// The latency bounds hold for a release build; a sanitizer build runs several times
// slower throughout, so its bounds are that much wider.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr double kSlowdown = 10;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr double kSlowdown = 10;
#else
constexpr double kSlowdown = 1;
#endif
#else
constexpr double kSlowdown = 1;
#endif

#define ASSERT_OK(expr) ASSERT_TRUE((expr).ok()) << (expr).status()
#define ASSERT_STATUS_OK(expr)            \
  do {                                    \
    const auto status_ = (expr);          \
    ASSERT_TRUE(status_.ok()) << status_; \
  } while (false)

absl::StatusOr<TestDaemon> StartShared(const std::string& name, std::vector<std::string> args) {
  return StartAdmitting(name, std::move(args), {kNobody});
}

// tsm_lease_attacker as uid 65534, its pages filled once it printed "filled".
ChildProcess StartAttacker(const TestDaemon& daemon, int sessions, const std::string& ids,
                           uint64_t first) {
  static int runs = 0;
  absl::StatusOr<ChildProcess> child = ChildProcess::Start(
      {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
       TSM_LEASE_ATTACKER_PATH, daemon.socket(), "--sessions", std::to_string(sessions), "--ids",
       ids, "--first", std::to_string(first)},
      absl::StrCat(daemon.dir(), "/attacker-", ++runs, ".log"));
  TSM_CHECK(child.ok());
  return *std::move(child);
}

std::shared_ptr<Client> Connect(const TestDaemon& daemon, const std::string& name) {
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon.socket(), name});
  TSM_CHECK(client.ok());
  return *std::move(client);
}

tensorshm::Status PublishBytes(Client& client, const std::string& name, int64_t bytes) {
  tensorshm::StatusOr<WritableTensor> w = client.Create({{kDLUInt, 8, 1}, {bytes}});
  if (!w.ok()) return w.status();
  if (bytes > 0) std::memset(w->data(), 7, static_cast<size_t>(bytes));
  return client.Publish(*w, name);
}

int64_t HostUsed(Client& client) {
  tensorshm::StatusOr<ServerStats> stats = client.Stat();
  TSM_CHECK(stats.ok() && !stats->pools.empty());
  return stats->pools[0].used_bytes;
}

// Polls (bounded, 3 s) until the host pool's use is `bytes`.
bool WaitForHostUsed(Client& client, int64_t bytes) {
  for (int i = 0; i < 300; ++i) {
    if (HostUsed(client) == bytes) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

TEST(LeasePageAttackTest, FullPagesOfDistinctIdsLeaveStatAndListFast) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the attacker as uid 65534";
  absl::StatusOr<TestDaemon> daemon = StartShared("lease-attack-scan", {});
  ASSERT_OK(daemon);
  std::shared_ptr<Client> owner = Connect(*daemon, "owner");
  constexpr int kTensors = 200;
  for (int i = 0; i < kTensors; ++i)
    ASSERT_STATUS_OK(PublishBytes(*owner, absl::StrCat("t/", i), 64));

  // The default --uid-sessions: 1024 sessions, every slot of every page a distinct id.
  constexpr int kSessions = 1024;
  ChildProcess attacker = StartAttacker(*daemon, kSessions, "distinct", uint64_t{1} << 40);
  ASSERT_TRUE(attacker.WaitForOutput("filled\n", absl::Seconds(240))) << attacker.Output();
  // The daemon takes the pages in: Sessions reads every session's page.
  tensorshm::StatusOr<std::vector<SessionInfo>> read = owner->Sessions();
  ASSERT_OK(read);

  // Three rounds, 100 ms apart, and the best round's median: a scan of every slot would cost
  // every round alike; a build or another suite beside the test slows some rounds, not all.
  std::vector<double> stats_ms;
  std::vector<double> list_ms;
  double stat_p50 = 1e9;
  double list_p50 = 1e9;
  for (int round = 0; round < 3; ++round) {
    std::vector<double> round_stats_ms;
    for (int i = 0; i < 50; ++i) {
      const absl::Time start = absl::Now();
      tensorshm::StatusOr<ServerStats> stats = owner->Stat();
      round_stats_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
      ASSERT_OK(stats);
      EXPECT_EQ(stats->sessions, kSessions + 1);
      EXPECT_EQ(stats->leases, 0) << "ids of no tensor are no leases";
    }
    std::vector<double> round_list_ms;
    for (int i = 0; i < 5; ++i) {
      const absl::Time start = absl::Now();
      tensorshm::StatusOr<std::vector<TensorInfo>> listed = owner->List("t/");
      round_list_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
      ASSERT_OK(listed);
      ASSERT_EQ(listed->size(), static_cast<size_t>(kTensors));
    }
    stat_p50 = std::min(stat_p50, Median(round_stats_ms));
    list_p50 = std::min(list_p50, Median(round_list_ms));
    stats_ms.insert(stats_ms.end(), round_stats_ms.begin(), round_stats_ms.end());
    list_ms.insert(list_ms.end(), round_list_ms.begin(), round_list_ms.end());
    absl::SleepFor(absl::Milliseconds(100));
  }
  std::cout << "with " << kSessions << " full lease pages: owner's Stat p50 (best round) "
            << stat_p50 << " ms (max " << *std::max_element(stats_ms.begin(), stats_ms.end())
            << " ms), List of " << kTensors << " p50 (best round) " << list_p50 << " ms (max "
            << *std::max_element(list_ms.begin(), list_ms.end()) << " ms)" << std::endl;
  EXPECT_LT(stat_p50, 10.0 * kSlowdown);
  EXPECT_LT(list_p50, 50.0 * kSlowdown);
}

TEST(LeasePageAttackTest, PageOfIdsItCouldNotAcquirePinsNothingAndCountsWithinUidLeases) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the attacker as uid 65534";
  // --uid-quota: no stock, so tensor ids are handed out one per create, in order.
  absl::StatusOr<TestDaemon> daemon = StartShared(
      "lease-attack-pin", {"--uid-leases", "100", "--host-pool", "1Gi", "--uid-quota", "1Gi"});
  ASSERT_OK(daemon);
  std::shared_ptr<Client> owner = Connect(*daemon, "owner");
  const int64_t used_before = HostUsed(*owner);

  // Two pages holding ids 1..504 before any of them is handed out.
  ChildProcess attacker = StartAttacker(*daemon, 2, "range", 1);
  ASSERT_TRUE(attacker.WaitForOutput("filled\n", absl::Seconds(60))) << attacker.Output();
  // The daemon reads the pages before the ids are handed out (Sessions reads every session's).
  tensorshm::StatusOr<std::vector<SessionInfo>> sessions = owner->Sessions();
  ASSERT_OK(sessions);
  int64_t attacker_slots = 0;
  for (const SessionInfo& session : *sessions)
    if (session.uid == 65534) attacker_slots += session.page_leases;
  EXPECT_EQ(attacker_slots, 0) << "slots naming ids not handed out yet count nothing";

  constexpr int64_t kBytes = int64_t{32} << 20;
  for (int i = 0; i < 8; ++i)
    ASSERT_STATUS_OK(PublishBytes(*owner, absl::StrCat("big/", i), kBytes));
  tensorshm::StatusOr<ServerStats> stats = owner->Stat();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->leases, 0) << "slots written before their ids were handed out count nothing";
  for (int i = 0; i < 8; ++i) ASSERT_STATUS_OK(owner->Delete(absl::StrCat("big/", i)));
  EXPECT_TRUE(WaitForHostUsed(*owner, used_before))
      << "the pages kept " << HostUsed(*owner) - used_before << " bytes of deleted tensors";

  // Published first, then written into the pages: tensors the uid could acquire, counted as
  // leases up to its --uid-leases and no further.
  for (int i = 0; i < 200; ++i)
    ASSERT_STATUS_OK(PublishBytes(*owner, absl::StrCat("small/", i), 64));
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = owner->List("small/");
  ASSERT_OK(listed);
  uint64_t first_id = ~uint64_t{0};
  uint64_t last_id = 0;
  for (const TensorInfo& info : *listed) {
    first_id = std::min(first_id, info.tensor_id);
    last_id = std::max(last_id, info.tensor_id);
  }
  ASSERT_LT(last_id - first_id, 504u) << "one page's slots name them all";
  ChildProcess second = StartAttacker(*daemon, 2, "range", first_id);
  ASSERT_TRUE(second.WaitForOutput("filled\n", absl::Seconds(60))) << second.Output();
  int64_t leases = 0;
  for (int i = 0; i < 300 && leases < 100; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    stats = owner->Stat();
    ASSERT_OK(stats);
    leases = stats->leases;
  }
  EXPECT_EQ(leases, 100) << "the uid's slots count up to --uid-leases 100";
  listed = owner->List("small/");
  ASSERT_OK(listed);
  int64_t listed_leases = 0;
  for (const TensorInfo& info : *listed) listed_leases += info.leases;
  EXPECT_EQ(listed_leases, 100);
  // Deleting them all: what the uncounted slots hold is freed at once; the 100 counted stay
  // (the uid could have acquired them) until the attacker lets go.
  for (int i = 0; i < 200; ++i) ASSERT_STATUS_OK(owner->Delete(absl::StrCat("small/", i)));
  stats = owner->Stat();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->tensors, 100);
  second.Kill(SIGKILL);
  attacker.Kill(SIGKILL);
  EXPECT_TRUE(WaitForHostUsed(*owner, used_before));
  stats = owner->Stat();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->leases, 0);
}

TEST(LeasePageAttackTest, RealFastPathLeaseStillKeepsADeletedTensor) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the attacker as uid 65534";
  absl::StatusOr<TestDaemon> daemon = StartShared("lease-attack-legit", {"--host-pool", "256Mi"});
  ASSERT_OK(daemon);
  std::shared_ptr<Client> owner = Connect(*daemon, "owner");
  std::shared_ptr<Client> reader = Connect(*daemon, "reader");
  // Beside a hostile uid's full pages.
  ChildProcess attacker = StartAttacker(*daemon, 4, "distinct", 1);
  ASSERT_TRUE(attacker.WaitForOutput("filled\n", absl::Seconds(60))) << attacker.Output();
  const int64_t used_before = HostUsed(*owner);

  constexpr int64_t kBytes = int64_t{32} << 20;
  ASSERT_STATUS_OK(PublishBytes(*owner, "x", kBytes));
  // The reader's fast path is set up beside its session: answered locally once it is.
  tensorshm::StatusOr<DLManagedTensorVersioned*> held = reader->TryAcquireLocal("x");
  for (int i = 0; i < 200 && !held.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    held = reader->TryAcquireLocal("x");
  }
  ASSERT_OK(held) << "the fast path serves it";
  ASSERT_STATUS_OK(owner->Delete("x"));
  // The memory stays while the lease is held, across housekeeping rounds.
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(HostUsed(*owner), used_before + kBytes);
  const auto* bytes = static_cast<const uint8_t*>((*held)->dl_tensor.data);
  EXPECT_EQ(bytes[0], 7);
  EXPECT_EQ(bytes[kBytes - 1], 7);
  tensorshm::StatusOr<ServerStats> stats = owner->Stat();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->leases, 1);
  (*held)->deleter(*held);
  EXPECT_TRUE(WaitForHostUsed(*owner, used_before)) << "freed once the lease ends";
}

}  // namespace
}  // namespace tensorshm::testing
