// Stress tests with bounded counts and time: clients SIGKILLed at random points, and a load of
// concurrent client processes. Seeds are fixed and printed on failure.
#include <signal.h>
#include <sys/wait.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/test_daemon.h"

namespace tensorshm::testing {
namespace {

class StressTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
        name.substr(0, 20),
        {"--host-pool", "512Mi", "--segment-size", "64Mi", "--max-tensors", "16384"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    absl::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "stress_test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
    // Shared tensors every client reads.
    for (int i = 0; i < 4; ++i) {
      absl::StatusOr<WritableTensor> w = client_->Create({{kDLFloat, 32, 1}, {4096 * (i + 1)}});
      ASSERT_TRUE(w.ok());
      ASSERT_TRUE(client_->Publish(*w, absl::StrCat("shared/", i)).ok());
    }
    absl::StatusOr<ServerStats> stats = client_->Stat();
    ASSERT_TRUE(stats.ok());
    baseline_ = *stats;
  }

  ChildProcess Peer(std::vector<std::string> args, int index) {
    std::vector<std::string> argv = {PeerPath(), args.at(0), daemon_->socket()};
    argv.insert(argv.end(), args.begin() + 1, args.end());
    for (int i = 0; i < 4; ++i) argv.push_back(absl::StrCat("shared/", i));
    absl::StatusOr<ChildProcess> child =
        ChildProcess::Start(argv, absl::StrCat(daemon_->dir(), "/peer-", index, ".log"));
    TSM_CHECK(child.ok());
    return *std::move(child);
  }

  // Waits (bounded) until the daemon is back at the baseline; returns how long that took.
  absl::StatusOr<absl::Duration> WaitForBaseline() {
    const absl::Time start = absl::Now();
    while (absl::Now() - start < absl::Seconds(20)) {
      absl::StatusOr<ServerStats> s = client_->Stat();
      if (!s.ok()) return s.status();
      if (s->leases == baseline_.leases && s->tensors == baseline_.tensors &&
          s->sessions == baseline_.sessions &&
          s->pools[0].used_bytes == baseline_.pools[0].used_bytes) {
        return absl::Now() - start;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    absl::StatusOr<ServerStats> s = client_->Stat();
    return absl::DeadlineExceededError(
        absl::StrCat("not back at baseline: leases ", s->leases, ", tensors ", s->tensors,
                     ", sessions ", s->sessions, ", used ", s->pools[0].used_bytes, " (baseline ",
                     baseline_.pools[0].used_bytes, ")"));
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
  ServerStats baseline_;
};

TEST_F(StressTest, ClientDeathTwoHundredClientsKilledAtRandomPoints) {
  const uint32_t seed = 5150;
  std::mt19937 random(seed);
  constexpr int kClients = 200;
  constexpr int kWave = 20;
  absl::Duration slowest = absl::ZeroDuration();
  for (int wave = 0; wave < kClients / kWave; ++wave) {
    std::vector<ChildProcess> peers;
    for (int i = 0; i < kWave; ++i) {
      const int index = wave * kWave + i;
      peers.push_back(Peer({"churn", "--seed", std::to_string(random())}, index));
    }
    for (ChildProcess& peer : peers) {
      ASSERT_TRUE(peer.WaitForOutput("churning", absl::Seconds(30)))
          << "seed " << seed << ": " << peer.Output();
    }
    // Kill each at a random point of its churn.
    for (ChildProcess& peer : peers) {
      absl::SleepFor(absl::Milliseconds(random() % 40));
      peer.Kill(SIGKILL);
    }
    for (ChildProcess& peer : peers) {
      absl::StatusOr<int> status = peer.Wait(absl::Seconds(10));
      ASSERT_TRUE(status.ok());
      // Killed mid-churn, not failed on its own.
      EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL)
          << "seed " << seed << ": " << peer.Output();
    }
    absl::StatusOr<absl::Duration> reclaimed = WaitForBaseline();
    ASSERT_TRUE(reclaimed.ok()) << "seed " << seed << ", wave " << wave << ": "
                                << reclaimed.status();
    slowest = std::max(slowest, *reclaimed);
  }
  std::cout << "reclaimed every wave of " << kWave << " killed clients within "
            << absl::FormatDuration(slowest) << std::endl;
}

TEST_F(StressTest, LoadSixteenClientProcessesMixedOperations) {
  constexpr int kClients = 16;
  constexpr int kOps = 1500;
  std::vector<ChildProcess> peers;
  for (int i = 0; i < kClients; ++i) {
    peers.push_back(
        Peer({"load", "--ops", std::to_string(kOps), "--seed", std::to_string(1000 + i)}, i));
  }
  for (ChildProcess& peer : peers) {
    absl::StatusOr<int> status = peer.Wait(absl::Seconds(300));
    ASSERT_TRUE(status.ok()) << "load client still running after 300 s";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << peer.Output();
    EXPECT_NE(peer.Output().find(absl::StrCat("load ok ", kOps)), std::string::npos)
        << peer.Output();
  }
  absl::StatusOr<absl::Duration> back = WaitForBaseline();
  EXPECT_TRUE(back.ok()) << back.status();
}

}  // namespace
}  // namespace tensorshm::testing
