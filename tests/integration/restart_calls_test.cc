// Calls ride through a daemon restart (issue 21): a call whose deadline has not passed waits for
// the client's reconnect and runs on the new session; a publish in flight when the daemon died
// answers UNAVAILABLE saying its fate is unknown. And Connect has a deadline on every wait: a
// stopped daemon, a missing socket, a canceller.
#include <signal.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

// A daemon on `socket` with shm prefix `prefix`, started and serving. Its tensors outlive it:
// recovered after a SIGKILL, kept (--keep-segments) after a clean stop.
absl::StatusOr<ChildProcess> StartDaemon(const std::string& socket, const std::string& prefix,
                                         const std::string& log) {
  absl::StatusOr<ChildProcess> daemon =
      ChildProcess::Start({TensorShmdPath(), "--socket", socket, "--shm-prefix", prefix,
                           "--host-pool", "64Mi", "--recovery-grace", "10", "--keep-segments"},
                          log);
  if (!daemon.ok()) return daemon.status();
  if (!daemon->WaitForOutput("serving on", absl::Seconds(20))) {
    return absl::InternalError("tensorshmd did not start: " + daemon->Output());
  }
  return daemon;
}

class RestartCallsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = absl::StrCat("tsmtest-ride-", getpid());
    dir_ = std::filesystem::temp_directory_path().string() + "/" + prefix_;
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    RemoveShmObjects(prefix_);
    socket_ = dir_ + "/s.sock";
  }
  // The daemons (locals of each test) are gone by now; --keep-segments left their objects.
  void TearDown() override {
    RemoveShmObjects(prefix_);
    std::filesystem::remove_all(dir_);
  }

  // Stops the daemon with `signal_number` and starts it again on the same socket and prefix.
  void Restart(absl::StatusOr<ChildProcess>& daemon, int signal_number) {
    daemon->Kill(signal_number);
    ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
    daemon = StartDaemon(socket_, prefix_, absl::StrCat(dir_, "/d", ++starts_, ".log"));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
  }

  std::string prefix_;
  std::string dir_;
  std::string socket_;
  int starts_ = 0;
};

TEST_F(RestartCallsTest, StatAndAcquireRideThroughSigkillAndCleanRestart) {
  absl::StatusOr<ChildProcess> daemon = StartDaemon(socket_, prefix_, dir_ + "/d0.log");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{socket_, "rider"});
  ASSERT_TRUE(client.ok()) << client.status();
  {
    tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLUInt, 8, 1}, {4096}});
    ASSERT_TRUE(w.ok()) << w.status();
    std::memset(w->data(), 0x3c, 4096);
    ASSERT_TRUE((*client)->Publish(*w, "ride/x").ok());
  }

  std::atomic<bool> stop{false};
  std::atomic<int> calls{0};
  std::atomic<int> failures{0};
  std::string first_failure;
  std::thread loop([&] {
    while (!stop.load()) {
      tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
      tensorshm::StatusOr<DLManagedTensorVersioned*> t =
          (*client)->Acquire("ride/x", std::chrono::seconds(5));
      tensorshm::Status bad = !stats.ok() ? stats.status() : t.status();
      if (t.ok()) {
        if (static_cast<const uint8_t*>((*t)->dl_tensor.data)[4095] != 0x3c) {
          bad = tensorshm::Status(tensorshm::StatusCode::kDataLoss, "wrong bytes");
        }
        (*t)->deleter(*t);
      }
      calls += 2;
      if (!bad.ok() && failures++ == 0) first_failure = bad.ToString();
    }
  });
  auto calls_go_on = [&] {
    const int before = calls.load();
    for (int i = 0; i < 1000 && calls.load() < before + 20; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return calls.load() >= before + 20;
  };
  EXPECT_TRUE(calls_go_on());
  const uint64_t first_instance = (*client)->daemon_instance();
  Restart(daemon, SIGKILL);
  EXPECT_TRUE(calls_go_on());
  const uint64_t second_instance = (*client)->daemon_instance();
  Restart(daemon, SIGTERM);
  EXPECT_TRUE(calls_go_on());
  stop = true;
  loop.join();
  EXPECT_NE(first_instance, second_instance);
  EXPECT_NE((*client)->daemon_instance(), second_instance);
  std::cout << calls.load() << " calls across a SIGKILL and a SIGTERM restart, " << failures.load()
            << " failed" << std::endl;
  EXPECT_EQ(failures.load(), 0) << first_failure;
  client->reset();
  daemon->Kill(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
}

TEST_F(RestartCallsTest, PublishInFlightAtTheKillSaysItsFateIsUnknown) {
  absl::StatusOr<ChildProcess> daemon = StartDaemon(socket_, prefix_, dir_ + "/d0.log");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{socket_, "publisher"});
  ASSERT_TRUE(client.ok()) << client.status();
  tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLFloat, 32, 1}, {1024}});
  ASSERT_TRUE(w.ok()) << w.status();
  std::memset(w->data(), 0, 4096);

  // Stopped, the daemon cannot answer: the publish is sent and waits for its reply.
  daemon->Kill(SIGSTOP);
  ASSERT_TRUE(WaitUntilStopped(daemon->pid(), absl::Seconds(10)));
  const int64_t unread = UnreadSocketBytes();
  tensorshm::Status published;
  std::thread publisher([&] { published = (*client)->Publish(*w, "fate/x"); });
  // The request is sent: it lies unread in the stopped daemon's socket.
  bool sent = false;
  for (int i = 0; i < 10000 && !sent; ++i) {
    sent = UnreadSocketBytes() > unread;
    if (!sent) absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_TRUE(sent) << "no request reached the daemon's socket";
  Restart(daemon, SIGKILL);
  publisher.join();
  EXPECT_EQ(published.code(), absl::StatusCode::kUnavailable) << published;
  EXPECT_TRUE(absl::StrContains(published.message(), "fate unknown")) << published;
  EXPECT_TRUE(absl::StrContains(published.message(), "fate/x")) << published;
  std::cout << "publish in flight: " << published << std::endl;
  // The client goes on on its new session.
  tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
  EXPECT_TRUE(stats.ok()) << stats.status();
  client->reset();
  daemon->Kill(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
}

TEST_F(RestartCallsTest, ConnectToAStoppedDaemonFailsByItsTimeout) {
  absl::StatusOr<ChildProcess> daemon = StartDaemon(socket_, prefix_, dir_ + "/d0.log");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  daemon->Kill(SIGSTOP);
  ClientOptions options{socket_, "stopped"};
  options.connect_timeout = std::chrono::seconds(1);
  const absl::Time start = absl::Now();
  tensorshm::StatusOr<std::shared_ptr<Client>> client = Client::Connect(options);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(client.status().code(), tensorshm::StatusCode::kUnavailable) << client.status();
  EXPECT_TRUE(absl::StrContains(client.status().message(), socket_)) << client.status();
  EXPECT_LT(took, absl::Seconds(3));
  std::cout << "connect to a stopped daemon failed after " << took << ": " << client.status()
            << std::endl;

  // A canceller ends the wait too, long before the timeout: once the connect is in the wait
  // (its connection queued in the stopped daemon's backlog).
  options.connect_timeout = std::chrono::seconds(60);
  WaitCanceller cancel;
  const int queued = ListenBacklog(socket_);
  ASSERT_GE(queued, 0) << "ss -xl cannot read " << socket_;
  std::thread canceller([&] {
    for (int i = 0; i < 10000 && ListenBacklog(socket_) <= queued; ++i)
      absl::SleepFor(absl::Milliseconds(1));
    cancel.Cancel();
  });
  const absl::Time second = absl::Now();
  client = Client::Connect(options, cancel);
  canceller.join();
  EXPECT_EQ(client.status().code(), absl::StatusCode::kCancelled) << client.status();
  EXPECT_LT(absl::Now() - second, absl::Seconds(5));

  daemon->Kill(SIGCONT);
  options.connect_timeout = std::chrono::seconds(5);
  client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  client->reset();
  daemon->Kill(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
}

TEST_F(RestartCallsTest, SessionIdIsTheDaemonsNumberNotTheToken) {
  absl::StatusOr<ChildProcess> daemon = StartDaemon(socket_, prefix_, dir_ + "/d0.log");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{socket_, "id"});
  ASSERT_TRUE(client.ok()) << client.status();
  tensorshm::StatusOr<std::vector<SessionInfo>> sessions = (*client)->Sessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  int own = 0;
  for (const SessionInfo& info : *sessions) {
    if (!info.own) continue;
    ++own;
    EXPECT_EQ((*client)->session_id(), absl::StrCat(info.session_id));
  }
  EXPECT_EQ(own, 1);
  EXPECT_LT((*client)->session_id().size(), 20u);  // the token is 32 hex digits
  client->reset();
  daemon->Kill(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
}

TEST_F(RestartCallsTest, MissingSocketFailsAtOnceNamingThePath) {
  ClientOptions options{dir_ + "/no-such.sock", "missing"};
  options.connect_timeout = std::chrono::seconds(10);
  const absl::Time start = absl::Now();
  tensorshm::StatusOr<std::shared_ptr<Client>> client = Client::Connect(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable) << client.status();
  EXPECT_TRUE(absl::StrContains(client.status().message(), options.socket)) << client.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

}  // namespace
}  // namespace tensorshm::testing
