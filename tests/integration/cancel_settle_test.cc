// Cancels settled by the daemon: a cancel that crosses the daemon's OK answer to an Acquire or a
// waiting Create leaves no lease and no buffer, because the client settles the call's request id
// on its session stream (ReleaseBatch.settled_request_ids). The daemon's test hook
// TENSORSHMD_TEST_CROSS_CANCEL_MS makes the crossing certain: it holds each granting answer
// back, and lets the call's own cancellation give nothing back, so only the settle can. Real
// daemon, real gRPC; this process is the client (and, for the wire-level cases, a raw session).
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/raw_session.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

// How long the daemon holds a granting answer back: the test sees the grant (Stat) and cancels
// within it. Generous for a loaded machine; a round that missed it is counted, not failed.
constexpr int kHoldMs = 600;
constexpr int kRounds = 12;
constexpr int64_t kPoolBytes = 4 << 20;

class CancelSettleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    absl::StatusOr<TestDaemon> daemon =
        TestDaemon::Start(absl::StrCat("settle-", name.substr(0, 16)),
                          {"--host-pool", "4Mi", "--segment-size", "4Mi"},
                          {absl::StrCat("TENSORSHMD_TEST_CROSS_CANCEL_MS=", kHoldMs)});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    for (auto* client : {&producer_, &consumer_}) {
      tensorshm::StatusOr<std::shared_ptr<Client>> connected =
          Client::Connect(ClientOptions{daemon_->socket(), "cancel_settle_test"});
      ASSERT_TRUE(connected.ok()) << connected.status();
      *client = *std::move(connected);
    }
  }

  ServerStats Stats() {
    tensorshm::StatusOr<ServerStats> stats = producer_->Stat();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : ServerStats{};
  }

  // The consumer's session as the daemon counts it.
  SessionInfo ConsumerSession() {
    tensorshm::StatusOr<std::vector<SessionInfo>> sessions = consumer_->Sessions();
    EXPECT_TRUE(sessions.ok()) << sessions.status();
    if (sessions.ok()) {
      for (const SessionInfo& info : *sessions) {
        if (info.own) return info;
      }
    }
    ADD_FAILURE() << "the consumer's session is not listed";
    return SessionInfo{};
  }

  // Polls Stat until `done` holds (bounded); false if it never did.
  template <typename Predicate>
  bool StatsBecome(Predicate done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      if (done(Stats())) return true;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return false;
  }

  int64_t UsedBytes() {
    const ServerStats stats = Stats();
    return stats.pools.empty() ? -1 : stats.pools[0].used_bytes;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> producer_;
  std::shared_ptr<Client> consumer_;
};

TEST_F(CancelSettleTest, AnAcquireCancelledAfterItsGrantLeavesNoLease) {
  tensorshm::StatusOr<WritableTensor> w = producer_->Create({{kDLFloat, 32, 1}, {256}});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(producer_->Publish(*w, "weights").ok());
  int crossed = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    WaitCanceller cancel;
    std::future<tensorshm::Status> acquired = std::async(std::launch::async, [&] {
      tensorshm::StatusOr<DLManagedTensorVersioned*> t =
          consumer_->Acquire("weights", std::chrono::seconds(60), ReadySync::Host(), cancel);
      if (t.ok()) (*t)->deleter(*t);
      return t.status();
    });
    // The daemon granted the lease; its answer is held back: the cancel lands after the grant.
    ASSERT_TRUE(StatsBecome([](const ServerStats& s) { return s.leases == 1; }));
    cancel.Cancel();
    const tensorshm::Status status = acquired.get();
    if (status.code() == tensorshm::StatusCode::kCancelled) {
      ++crossed;
    } else {
      EXPECT_TRUE(status.ok()) << status;  // the answer came first: released above
    }
    // The settle (or the release) went with the consumer's next batch.
    ASSERT_TRUE(consumer_->Flush().ok());
    EXPECT_EQ(Stats().leases, 0);
    const SessionInfo session = ConsumerSession();
    EXPECT_EQ(session.rpc_leases, 0);
    EXPECT_EQ(session.page_leases, 0);
  }
  std::printf("acquire: %d of %d cancels crossed the grant; no lease left after any round\n",
              crossed, kRounds);
  EXPECT_GE(crossed, kRounds / 2);
  // The consumer is still served: a later acquire gets the tensor.
  tensorshm::StatusOr<DLManagedTensorVersioned*> t =
      consumer_->Acquire("weights", std::chrono::seconds(60), ReadySync::Host());
  ASSERT_TRUE(t.ok()) << t.status();
  (*t)->deleter(*t);
  ASSERT_TRUE(consumer_->Flush().ok());
  EXPECT_EQ(Stats().leases, 0);
}

TEST_F(CancelSettleTest, AWaitingCreateCancelledAfterItsGrantLeavesNoBuffer) {
  const TensorSpec whole{{kDLUInt, 8, 1}, {kPoolBytes}};
  const TensorSpec quarter{{kDLUInt, 8, 1}, {kPoolBytes / 4}};
  int crossed = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    // The pool is full: the consumer's create waits in the daemon for memory.
    tensorshm::StatusOr<WritableTensor> big = producer_->Create(whole);
    ASSERT_TRUE(big.ok()) << big.status();
    ASSERT_TRUE(producer_->Publish(*big, "big").ok());
    WaitCanceller cancel;
    std::future<tensorshm::Status> created = std::async(std::launch::async, [&] {
      tensorshm::StatusOr<WritableTensor> t =
          consumer_->Create(quarter, std::chrono::seconds(60), cancel);
      return t.status();  // a tensor that came first is dropped here (abandoned)
    });
    ASSERT_TRUE(StatsBecome([](const ServerStats& s) { return s.creates_waiting == 1; }));
    // Memory comes free: the waiting create is served, its answer held back; then cancelled.
    ASSERT_TRUE(producer_->Delete("big").ok());
    ASSERT_TRUE(StatsBecome([](const ServerStats& s) {
      return s.creates_waiting == 0 && !s.pools.empty() && s.pools[0].used_bytes > 0;
    }));
    cancel.Cancel();
    const tensorshm::Status status = created.get();
    if (status.code() == tensorshm::StatusCode::kCancelled) {
      ++crossed;
    } else {
      EXPECT_TRUE(status.ok()) << status;
    }
    ASSERT_TRUE(consumer_->Flush().ok());
    EXPECT_EQ(UsedBytes(), 0);
    const SessionInfo session = ConsumerSession();
    EXPECT_EQ(session.unpublished_tensors, 0);
    EXPECT_EQ(session.unpublished_bytes, 0);
    EXPECT_EQ(Stats().tensors, 0);
  }
  std::printf("create: %d of %d cancels crossed the grant; no buffer left after any round\n",
              crossed, kRounds);
  EXPECT_GE(crossed, kRounds / 2);
}

// The wire protocol's other orderings, with a raw session: a settle before its call arrives
// refuses the call; a settle of a waiting call ends it; a settle of an id the daemon never granted
// changes nothing.
TEST_F(CancelSettleTest, SettlesBeforeArrivalAndDuringTheWait) {
  RawSession raw(daemon_->socket());
  ASSERT_TRUE(raw.Settle({7}));
  {
    PendingAcquire early(raw, "absent", /*wait_ms=*/-1, std::chrono::seconds(60), 7);
    const grpc::Status status = early.Wait();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
    EXPECT_NE(status.error_message().find("before it arrived"), std::string::npos)
        << status.error_message();
  }
  {
    PendingAcquire waiting(raw, "later", /*wait_ms=*/-1, std::chrono::seconds(60), 8);
    ASSERT_TRUE(StatsBecome([&](const ServerStats&) {
      const tensorshm::StatusOr<std::vector<SessionInfo>> sessions = consumer_->Sessions();
      if (!sessions.ok()) return false;
      for (const SessionInfo& info : *sessions) {
        if (info.waiting_acquires == 1) return true;
      }
      return false;
    }));
    ASSERT_TRUE(raw.Settle({8, 12345}));
    const grpc::Status status = waiting.Wait();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  }
  // Settled before the publish: the publish grants nothing to it.
  tensorshm::StatusOr<WritableTensor> w = producer_->Create({{kDLFloat, 32, 1}, {4}});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(producer_->Publish(*w, "later").ok());
  EXPECT_EQ(Stats().leases, 0);
  // A call with an id the daemon granted and nobody settled keeps its lease (a settle names the
  // call, nothing else).
  {
    PendingAcquire granted(raw, "later", /*wait_ms=*/0, std::chrono::seconds(60), 9);
    EXPECT_TRUE(granted.Wait().ok());
  }
  EXPECT_EQ(Stats().leases, 1);
  ASSERT_TRUE(raw.Settle({9}));
  EXPECT_EQ(Stats().leases, 0);
  ASSERT_TRUE(raw.Settle({9}));  // idempotent
  EXPECT_EQ(Stats().leases, 0);
}

}  // namespace
}  // namespace tensorshm::testing
