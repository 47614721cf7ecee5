// Waiting acquires: each is finished exactly once, by the publish of its name (either transport),
// its wait_ms or call deadline, its cancellation, the end of its session, or the daemon stopping;
// with the status each of those gave before waiters stopped polling.
#include <signal.h>
#include <sys/wait.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/raw_session.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

using grpc::StatusCode;

class WaiterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(name.substr(0, 24));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "waiter_test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();
  }

  int64_t Leases() {
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->leases : -1;
  }

  // Polls Stat until the daemon counts `leases` leases (bounded: what it waits for is a
  // cancellation on its way to the daemon).
  bool LeasesBecome(int64_t leases) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      if (Leases() == leases) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  // Acquires the daemon lists as waiting now (every session's waiting_acquires), -1 on error.
  int64_t AcquiresWaiting() {
    tensorshm::StatusOr<std::vector<SessionInfo>> sessions = client_->Sessions();
    EXPECT_TRUE(sessions.ok()) << sessions.status();
    if (!sessions.ok()) return -1;
    int64_t waiting = 0;
    for (const SessionInfo& session : *sessions) waiting += session.waiting_acquires;
    return waiting;
  }

  // Waits (bounded) until the daemon lists `count` waiting acquires: the calls just sent have
  // arrived and wait, so what happens next wakes them instead of meeting them on arrival.
  void AwaitWaitingAcquires(int64_t count) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (AcquiresWaiting() != count && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(AcquiresWaiting(), count) << "the daemon never listed the acquires as waiting";
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
};

TEST_F(WaiterTest, PublishOverTheMemoryChannelWakesEveryWaiterOfThatNameOnly) {
  RawSession session(daemon_->socket());
  ASSERT_FALSE(session.token().empty());
  PendingAcquire a1(session, "wake/a", -1);
  PendingAcquire a2(session, "wake/a", 60000);
  PendingAcquire a3(session, "wake/a", -1);
  PendingAcquire b(session, "wake/b", -1);
  ASSERT_NO_FATAL_FAILURE(AwaitWaitingAcquires(4));
  const int64_t leases_before = Leases();
  // The C++ client publishes over the memory channel.
  tensorshm::StatusOr<WritableTensor> w = client_->Create({{kDLUInt, 8, 1}, {128}});
  ASSERT_TRUE(w.ok()) << w.status();
  const uint64_t id = w->tensor_id();
  ASSERT_TRUE(client_->Publish(*w, "wake/a").ok());
  for (PendingAcquire* waiter : {&a1, &a2, &a3}) {
    grpc::Status status = waiter->Wait();
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(waiter->response().tensor_id(), id);
    EXPECT_EQ(waiter->response().desc().nbytes(), 128);
  }
  EXPECT_EQ(Leases(), leases_before + 3);
  EXPECT_FALSE(b.answered());
  // A waiter cancelled by its client is answered CANCELLED and keeps no lease: the daemon may
  // see the cancellation after the publish, but then drops the lease the lost answer carried.
  b.Cancel();
  EXPECT_EQ(b.Wait().error_code(), StatusCode::CANCELLED);
  ASSERT_NE(session.Publish("wake/b"), 0u);
  EXPECT_TRUE(LeasesBecome(leases_before + 3)) << Leases();
}

TEST_F(WaiterTest, PublishOverGrpcWakesWaitersOfEverySession) {
  RawSession waiting(daemon_->socket());
  RawSession other(daemon_->socket());
  RawSession producer(daemon_->socket());
  PendingAcquire mine(waiting, "grpc/x", -1);
  PendingAcquire theirs(other, "grpc/x", 30000);
  ASSERT_NO_FATAL_FAILURE(AwaitWaitingAcquires(2));
  const uint64_t id = producer.Publish("grpc/x");
  ASSERT_NE(id, 0u);
  EXPECT_TRUE(mine.Wait().ok());
  EXPECT_TRUE(theirs.Wait().ok());
  EXPECT_EQ(mine.response().tensor_id(), id);
  EXPECT_EQ(theirs.response().tensor_id(), id);
  EXPECT_NE(mine.response().lease_id(), theirs.response().lease_id());
  // A replace of the bound name answers new waiters with the new tensor at once.
  const uint64_t replaced = producer.Publish("grpc/x", /*replace=*/true);
  PendingAcquire later(waiting, "grpc/x", 30000);
  EXPECT_TRUE(later.Wait().ok());
  EXPECT_EQ(later.response().tensor_id(), replaced);
}

TEST_F(WaiterTest, WaitMsAndCallDeadlineEndInDeadlineExceeded) {
  RawSession session(daemon_->socket());
  PendingAcquire short_wait(session, "late/a", 300);
  PendingAcquire long_wait(session, "late/b", 60000);
  grpc::Status status = short_wait.Wait();
  EXPECT_EQ(status.error_code(), StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(status.error_message(), "name = \"late/a\": not published within wait_ms = 300");
  EXPECT_FALSE(long_wait.answered());
  // wait_ms < 0: until the call's deadline.
  PendingAcquire call_deadline(session, "late/c", -1, std::chrono::milliseconds(300));
  EXPECT_EQ(call_deadline.Wait().error_code(), StatusCode::DEADLINE_EXCEEDED);
  // wait_ms 0: NOT_FOUND at once.
  PendingAcquire no_wait(session, "late/d", 0);
  status = no_wait.Wait();
  EXPECT_EQ(status.error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "name = \"late/d\": not published");
  // Many deadlines, out of order: each ends on its own.
  std::vector<std::unique_ptr<PendingAcquire>> many;
  for (int i = 0; i < 50; ++i) {
    many.push_back(std::make_unique<PendingAcquire>(session, absl::StrCat("late/many", i),
                                                    100 + (i * 37) % 400));
  }
  for (auto& waiter : many) EXPECT_EQ(waiter->Wait().error_code(), StatusCode::DEADLINE_EXCEEDED);
  EXPECT_FALSE(long_wait.answered());
}

TEST_F(WaiterTest, EndOfTheSessionFailsItsWaitersOnly) {
  RawSession ending(daemon_->socket());
  RawSession staying(daemon_->socket());
  const std::string token = ending.token();
  PendingAcquire lost1(ending, "gone/a", -1);
  PendingAcquire lost2(ending, "gone/b", 60000);
  PendingAcquire kept(staying, "gone/a", -1);
  ASSERT_NO_FATAL_FAILURE(AwaitWaitingAcquires(3));
  ending.Close();
  for (PendingAcquire* waiter : {&lost1, &lost2}) {
    grpc::Status status = waiter->Wait();
    EXPECT_EQ(status.error_code(), StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(status.error_message(),
              absl::StrCat("metadata tensorshm-session = \"", token,
                           "\": no open session has this id (its stream ended, or it never "
                           "existed)"));
  }
  EXPECT_FALSE(kept.answered());
  ASSERT_NE(staying.Publish("gone/a"), 0u);
  EXPECT_TRUE(kept.Wait().ok());
}

TEST_F(WaiterTest, StoppingDaemonAnswersWaitersUnavailableAndExitsZero) {
  RawSession session(daemon_->socket());
  std::vector<std::unique_ptr<PendingAcquire>> waiters;
  for (int i = 0; i < 20; ++i) {
    waiters.push_back(
        std::make_unique<PendingAcquire>(session, absl::StrCat("stop/", i), i % 2 ? -1 : 60000));
  }
  ASSERT_NO_FATAL_FAILURE(AwaitWaitingAcquires(20));
  daemon_->process().Kill(SIGTERM);
  for (auto& waiter : waiters) {
    grpc::Status status = waiter->Wait();
    EXPECT_EQ(status.error_code(), StatusCode::UNAVAILABLE) << status.error_message();
    EXPECT_EQ(status.error_message(), "tensorshmd is stopping");
  }
  session.Close();
  client_.reset();
  absl::StatusOr<int> exited = daemon_->process().Wait(absl::Seconds(20));
  ASSERT_TRUE(exited.ok());
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 0) << daemon_->process().Output();
}

}  // namespace
}  // namespace tensorshm::testing
