// Stress test of the fast path (shared-memory catalog index and lease pages): one producer
// replacing a name 10,000 times, each version filled with its own number; consumer processes
// acquiring every version they can and checking every byte, twice, and again while they keep it;
// 50 more consumers SIGKILLed at random points. No byte may be wrong, and afterwards the daemon
// must be back at its baseline: no lease, no tensor, no pool byte more than before.
//
// The seed is fixed and printed on failure.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr char kName[] = "stress/replaced";
constexpr char kWitness[] = "stress/witness";

class FastPathStressTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    absl::StatusOr<TestDaemon> daemon =
        TestDaemon::Start(absl::StrCat("fps-", name.substr(0, 16)),
                          {"--host-pool", "256Mi", "--segment-size", "32Mi"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "fast_path_stress_test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_FALSE(stats->pools.empty());
    baseline_ = *stats;
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();
  }

  ChildProcess StartPeer(const std::vector<std::string>& args, const std::string& log_name) {
    std::vector<std::string> argv = {PeerPath(), args.at(0), daemon_->socket()};
    argv.insert(argv.end(), args.begin() + 1, args.end());
    absl::StatusOr<ChildProcess> child =
        ChildProcess::Start(argv, absl::StrCat(daemon_->dir(), "/", log_name, ".log"));
    TSM_CHECK(child.ok());
    return *std::move(child);
  }

  ServerStats Stats() {
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
    TSM_CHECK(stats.ok());
    return *stats;
  }

  static std::string Describe(const ServerStats& s) {
    return absl::StrCat("leases ", s.leases, ", tensors ", s.tensors, ", sessions ", s.sessions,
                        ", pool used ", s.pools.at(0).used_bytes);
  }

  // Polls (every 5 ms, at most `limit`) until `done(stats)`; returns how long that took, or
  // nullopt with the last stats in *last.
  std::optional<absl::Duration> PollUntil(const std::function<bool(const ServerStats&)>& done,
                                          absl::Duration limit, ServerStats* last) {
    const absl::Time start = absl::Now();
    while (true) {
      *last = Stats();
      if (done(*last)) return absl::Now() - start;
      if (absl::Now() - start > limit) return std::nullopt;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  // Waits (bounded) until the daemon is back at the baseline: no lease, tensor, session or pool
  // byte more than before the test.
  void ExpectBackAtBaseline() {
    ServerStats last;
    const std::optional<absl::Duration> took = PollUntil(
        [&](const ServerStats& s) {
          return s.leases == 0 && s.tensors == baseline_.tensors &&
                 s.sessions == baseline_.sessions &&
                 s.pools.at(0).used_bytes == baseline_.pools.at(0).used_bytes;
        },
        absl::Seconds(5), &last);
    EXPECT_TRUE(took.has_value()) << "not back at baseline after 5 s: " << Describe(last)
                                  << " (baseline " << Describe(baseline_) << ")";
    if (took.has_value()) {
      std::cout << "back at baseline (" << Describe(last) << ") after "
                << absl::FormatDuration(*took) << std::endl;
    }
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
  ServerStats baseline_;
};

// The number after `key` in the first line of `output` starting with `key`, or -1.
int64_t Number(const std::string& output, const std::string& key) {
  const std::vector<std::string> words = absl::StrSplit(Line(output, key), ' ');
  int64_t n = -1;
  if (words.empty() || !absl::SimpleAtoi(words[0], &n)) return -1;
  return n;
}

TEST_F(FastPathStressTest, TenThousandReplacementsCheckedByteForByteWithConsumersKilled) {
  const uint32_t seed = 60613;
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937 random(seed);
  constexpr int kVersions = 10000;
  constexpr int kConsumers = 4;
  constexpr int kKilled = 50;
  const absl::Time start = absl::Now();

  // Consumers first: they wait for the first publish. Each keeps its last K acquired versions
  // and re-checks them while the producer goes on replacing (and the freed buffers get reused).
  std::vector<ChildProcess> consumers;
  for (int i = 0; i < kConsumers; ++i) {
    consumers.push_back(
        StartPeer({"verify-loop", kName, "--until-version", std::to_string(kVersions), "--wait-ms",
                   "30000", "--bytes", "4096", "--max-bytes", "65536", "--keep",
                   std::to_string(1 + i * 2), "--seed", std::to_string(random())},
                  absl::StrCat("consumer-", i)));
  }
  // Sizes from 4 KiB to 64 KiB (any multiple of 4 bytes): buffers are reused at other offsets.
  ChildProcess producer =
      StartPeer({"replace-loop", kName, "--count", std::to_string(kVersions), "--bytes", "4096",
                 "--max-bytes", "65536", "--seed", std::to_string(random())},
                "producer");

  // Meanwhile: consumers killed with SIGKILL at random points, five at a time, holding up to 4
  // leases each. Every other one is killed at a random time after its start (maybe before it
  // even connected), the others a moment after their first checked acquire.
  constexpr int kBatch = 5;
  int killed_verifying = 0;  // killed after their first checked acquire
  int killed_while_producing = 0;
  for (int i = 0; i < kKilled; i += kBatch) {
    std::vector<ChildProcess> victims;
    for (int k = i; k < std::min(i + kBatch, kKilled); ++k) {
      victims.push_back(
          StartPeer({"verify-loop", kName, "--forever", "--wait-ms", "30000", "--bytes", "4096",
                     "--max-bytes", "65536", "--keep", std::to_string(1 + random() % 4), "--seed",
                     std::to_string(random())},
                    absl::StrCat("killed-", k)));
    }
    for (size_t k = 0; k < victims.size(); ++k) {
      ChildProcess& victim = victims[k];
      if (k % 2 == 1) {
        EXPECT_TRUE(victim.WaitForOutput("verifying", absl::Seconds(30))) << victim.Output();
        absl::SleepFor(absl::Milliseconds(random() % 20));
      } else {
        absl::SleepFor(absl::Milliseconds(random() % 80));
      }
      const bool producing = !producer.Wait(absl::ZeroDuration()).ok();
      victim.Kill(SIGKILL);
      absl::StatusOr<int> status = victim.Wait(absl::Seconds(10));
      ASSERT_TRUE(status.ok()) << status.status();
      // Killed, not failed on its own (a wrong byte exits 1).
      EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL) << victim.Output();
      killed_verifying += victim.Output().find("verifying") != std::string::npos;
      killed_while_producing += producing;
    }
  }

  absl::StatusOr<int> produced = producer.Wait(absl::Seconds(90));
  ASSERT_TRUE(produced.ok()) << "producer still running: " << producer.Output();
  EXPECT_TRUE(WIFEXITED(*produced) && WEXITSTATUS(*produced) == 0) << producer.Output();
  EXPECT_EQ(Number(producer.Output(), "published"), kVersions) << producer.Output();
  const absl::Duration producing = absl::Now() - start;  // or killing, whichever took longer
  int64_t verified_total = 0;
  for (int i = 0; i < kConsumers; ++i) {
    absl::StatusOr<int> status = consumers[i].Wait(absl::Seconds(60));
    ASSERT_TRUE(status.ok()) << "consumer " << i << " still running: " << consumers[i].Output();
    const std::string output = consumers[i].Output();
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0)
        << "consumer " << i << ": " << output;
    const std::vector<std::string> words = absl::StrSplit(Line(output, "verified"), ' ');
    // "verified <count> wrong 0 last <version>"
    ASSERT_EQ(words.size(), 5u) << "consumer " << i << ": " << output;
    int64_t verified = 0;
    ASSERT_TRUE(absl::SimpleAtoi(words[0], &verified)) << output;
    EXPECT_GT(verified, 0) << "consumer " << i << ": " << output;
    EXPECT_EQ(words[1], "wrong");
    EXPECT_EQ(words[2], "0") << "consumer " << i << " saw wrong bytes: " << output;
    EXPECT_EQ(words[4], std::to_string(kVersions)) << "consumer " << i << ": " << output;
    verified_total += verified;
  }
  std::cout << kVersions << " versions published and " << kKilled << " consumers killed within "
            << absl::FormatDuration(producing) << "; " << kConsumers << " consumers verified "
            << verified_total << " acquires, every byte, no wrong byte; of the killed consumers, "
            << killed_verifying << " had checked an acquire, " << killed_while_producing
            << " died while the producer ran" << std::endl;
  EXPECT_GT(killed_verifying, 0);
  // Consumers died while versions were being replaced, not only after the last one.
  EXPECT_GT(killed_while_producing, 0);

  ASSERT_TRUE(client_->Delete(kName).ok());
  ASSERT_TRUE(client_->Flush().ok());
  ExpectBackAtBaseline();
}

// A consumer killed while it holds a lease (taken through its lease page) on a replaced tensor:
// the daemon frees that tensor's memory when the session ends, not later. The versions are
// published by producer processes, so that this process's session never holds buffers.
TEST_F(FastPathStressTest, KilledHoldersLeaseIsReclaimedWhenItsSessionEnds) {
  constexpr int64_t kBytes = 16384;
  constexpr int kRounds = 5;
  const int64_t base_used = baseline_.pools.at(0).used_bytes;
  auto produce = [&](const std::string& log_name, const std::string& name = kName) {
    ChildProcess producer = StartPeer(
        {"produce", name, "--dtype", "uint32", "--shape", std::to_string(kBytes / 4), "--replace"},
        log_name);
    absl::StatusOr<int> status = producer.Wait(absl::Seconds(30));
    return status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0;
  };
  ASSERT_TRUE(produce("producer-0"));
  std::vector<double> took_ms;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    ChildProcess holder = StartPeer({"hold", kName}, absl::StrCat("holder-", round));
    ASSERT_TRUE(holder.WaitForOutput("held", absl::Seconds(30))) << holder.Output();
    ASSERT_TRUE(produce(absl::StrCat("producer-", round + 1)));  // replaces the held version
    // Once the producer's session is gone, the held version still holds its memory, for as
    // long as the holder lives: several reclaim periods.
    ServerStats held;
    ASSERT_TRUE(PollUntil(
                    [&](const ServerStats& s) {
                      return s.sessions == baseline_.sessions + 1 &&
                             s.tensors == baseline_.tensors + 2 &&
                             s.pools.at(0).used_bytes == base_used + 2 * kBytes;
                    },
                    absl::Seconds(2), &held)
                    .has_value())
        << "expected 2 tensors (the held one and its replacement): " << Describe(held);
    // Not vacuous: the daemon must have looked at the lease pages since. A witness version,
    // leased through this process's lease page, replaced, then released by a store (no call),
    // is freed only by the daemon's look at the pages; once it is, the held version must still
    // hold its memory.
    ASSERT_TRUE(produce(absl::StrCat("witness-", round), kWitness));
    tensorshm::StatusOr<DLManagedTensorVersioned*> witness = client_->Acquire(kWitness);
    ASSERT_TRUE(witness.ok()) << witness.status();
    ASSERT_TRUE(produce(absl::StrCat("witness-next-", round), kWitness));
    (*witness)->deleter(*witness);
    ASSERT_TRUE(PollUntil(
                    [&](const ServerStats& s) {
                      return s.tensors == baseline_.tensors + 3 &&
                             s.pools.at(0).used_bytes == base_used + 3 * kBytes;
                    },
                    absl::Seconds(10), &held)
                    .has_value())
        << "the released witness version was not freed within 10 s: " << Describe(held);
    EXPECT_EQ(held.leases, 1) << Describe(held);
    EXPECT_EQ(held.tensors, baseline_.tensors + 3) << Describe(held);
    EXPECT_EQ(held.pools.at(0).used_bytes, base_used + 3 * kBytes) << Describe(held);
    ASSERT_TRUE(client_->Delete(kWitness).ok());
    ASSERT_TRUE(PollUntil(
                    [&](const ServerStats& s) {
                      return s.tensors == baseline_.tensors + 2 &&
                             s.pools.at(0).used_bytes == base_used + 2 * kBytes;
                    },
                    absl::Seconds(10), &held)
                    .has_value())
        << "the witness was not freed at its delete: " << Describe(held);

    holder.Kill(SIGKILL);
    ServerStats last;
    const std::optional<absl::Duration> took = PollUntil(
        [&](const ServerStats& s) {
          return s.pools.at(0).used_bytes == base_used + kBytes && s.leases == 0 &&
                 s.tensors == baseline_.tensors + 1;
        },
        absl::Seconds(2), &last);
    ASSERT_TRUE(took.has_value()) << "killed holder's lease not reclaimed within 2 s: "
                                  << Describe(last);
    took_ms.push_back(absl::ToDoubleMilliseconds(*took));
    ASSERT_TRUE(holder.Wait(absl::Seconds(10)).ok());
  }
  std::sort(took_ms.begin(), took_ms.end());
  std::cout << "a killed holder's replaced tensor was freed after (ms, sorted):";
  for (double ms : took_ms) std::cout << " " << ms;
  std::cout << std::endl;

  ASSERT_TRUE(client_->Delete(kName).ok());
  ASSERT_TRUE(client_->Flush().ok());
  ExpectBackAtBaseline();
}

}  // namespace
}  // namespace tensorshm::testing
