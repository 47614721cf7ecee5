// WaitCanceller: a cancelled wait in Acquire (the fast path's futex sleep) or Create (a gRPC
// call waiting in the daemon for memory) answers CANCELLED well before its timeout, and leaves
// no lease or buffer in the daemon. Also the Client's daemon_instance() and socket(). A real
// daemon; this process is the client.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

// Generous: the waits cancelled below would last this long; a cancel must end them far sooner.
constexpr tensorshm::Duration kLongWait = std::chrono::seconds(60);

// True while thread `tid` of this process blocks in FUTEX_WAIT on a shared (not process-private)
// word: where the fast path sleeps for a publish. The client's own mutexes and condition
// variables wait on private words (FUTEX_WAIT_PRIVATE), so they do not count.
bool InSharedFutexWait(pid_t tid) {
  if (tid == 0) return false;
  std::ifstream in(absl::StrCat("/proc/self/task/", tid, "/syscall"));
  std::string number, word, op;
  if (!(in >> number >> word >> op)) return false;  // "running", or the thread is gone
  return number == std::to_string(SYS_futex) && std::stoull(op, nullptr, 16) == FUTEX_WAIT;
}

class WaitCancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TestDaemon> daemon =
        TestDaemon::Start("wait-cancel", {"--host-pool", "4Mi", "--segment-size", "4Mi"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "wait_cancel_test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  ServerStats Stats() {
    EXPECT_TRUE(client_->Flush().ok());
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : ServerStats{};
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
};

TEST_F(WaitCancelTest, CancelWakesAWaitingAcquire) {
  WaitCanceller cancel;
  const absl::Time start = absl::Now();
  std::future<tensorshm::Status> waited = std::async(std::launch::async, [&] {
    tensorshm::StatusOr<DLManagedTensorVersioned*> t =
        client_->Acquire("never", tensorshm::kForever, ReadySync::Host(), cancel);
    if (t.ok()) (*t)->deleter(*t);
    return t.status();
  });
  // Not yet: the acquire waits (a publish of another name does not end it).
  EXPECT_EQ(waited.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  cancel.Cancel();
  ASSERT_EQ(waited.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const tensorshm::Status status = waited.get();
  EXPECT_EQ(status.code(), tensorshm::StatusCode::kCancelled) << status;
  EXPECT_NE(status.message().find("name = \"never\""), std::string_view::npos) << status;
  EXPECT_LT(absl::Now() - start, absl::FromChrono(kLongWait / 2));
  EXPECT_TRUE(cancel.cancelled());
  EXPECT_EQ(Stats().leases, 0);
}

TEST_F(WaitCancelTest, ACancelledCancellerFailsLaterWaitsAtOnceAndOthersStillWait) {
  WaitCanceller cancel;
  cancel.Cancel();
  cancel.Cancel();  // idempotent
  tensorshm::StatusOr<DLManagedTensorVersioned*> t =
      client_->Acquire("never", kLongWait, ReadySync::Host(), cancel);
  EXPECT_EQ(t.status().code(), tensorshm::StatusCode::kCancelled) << t.status();
  // A call that does not wait is not refused: the name is published, or NOT_FOUND.
  tensorshm::StatusOr<WritableTensor> w = client_->Create({{kDLFloat, 32, 1}, {4}});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(client_->Publish(*w, "there").ok());
  t = client_->Acquire("there", tensorshm::Duration::zero(), ReadySync::Host(), cancel);
  ASSERT_TRUE(t.ok()) << t.status();
  (*t)->deleter(*t);
  t = client_->Acquire("absent", tensorshm::Duration::zero(), ReadySync::Host(), cancel);
  EXPECT_EQ(t.status().code(), tensorshm::StatusCode::kNotFound) << t.status();
  // Another canceller's acquire still waits, and gets the publish it waited for.
  WaitCanceller other;
  std::future<tensorshm::StatusOr<DLManagedTensorVersioned*>> waited =
      std::async(std::launch::async,
                 [&] { return client_->Acquire("later", kLongWait, ReadySync::Host(), other); });
  EXPECT_EQ(waited.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  tensorshm::StatusOr<WritableTensor> later = client_->Create({{kDLFloat, 32, 1}, {4}});
  ASSERT_TRUE(later.ok()) << later.status();
  ASSERT_TRUE(client_->Publish(*later, "later").ok());
  tensorshm::StatusOr<DLManagedTensorVersioned*> got = waited.get();
  ASSERT_TRUE(got.ok()) << got.status();
  (*got)->deleter(*got);
  EXPECT_EQ(Stats().leases, 0);
}

TEST_F(WaitCancelTest, OneCancelWakesEveryWaiterSharingIt) {
  WaitCanceller cancel;
  std::vector<std::future<tensorshm::Status>> waiters;
  std::vector<std::atomic<pid_t>> threads(4);
  for (int i = 0; i < 4; ++i) {
    waiters.push_back(std::async(std::launch::async, [&, i] {
      threads[i].store(static_cast<pid_t>(syscall(SYS_gettid)));
      return client_->Acquire("never", tensorshm::kForever, ReadySync::Host(), cancel).status();
    }));
  }
  // The cancel must wake sleepers: each waiter is seen asleep in the fast path's futex first.
  for (std::atomic<pid_t>& thread : threads) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!InSharedFutexWait(thread.load()) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_TRUE(InSharedFutexWait(thread.load())) << "a waiter never slept in the fast path";
  }
  cancel.Cancel();
  for (auto& waiter : waiters) {
    ASSERT_EQ(waiter.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    EXPECT_EQ(waiter.get().code(), tensorshm::StatusCode::kCancelled);
  }
}

TEST_F(WaitCancelTest, CancelEndsACreateWaitingForMemory) {
  // The pool is one 4 MiB segment: the first create fills it, the second waits in the daemon.
  tensorshm::StatusOr<WritableTensor> full = client_->Create({{kDLUInt, 8, 1}, {4 << 20}});
  ASSERT_TRUE(full.ok()) << full.status();
  WaitCanceller cancel;
  const absl::Time start = absl::Now();
  std::future<tensorshm::Status> waited = std::async(std::launch::async, [&] {
    return client_->Create({{kDLUInt, 8, 1}, {1 << 20}}, tensorshm::kForever, cancel).status();
  });
  // Only for the create to be waiting in the daemon when cancelled; a cancel before the call
  // starts ends it the same way.
  for (int i = 0; i < 500 && Stats().creates_waiting == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(Stats().creates_waiting, 1);
  cancel.Cancel();
  ASSERT_EQ(waited.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const tensorshm::Status status = waited.get();
  EXPECT_EQ(status.code(), tensorshm::StatusCode::kCancelled) << status;
  EXPECT_LT(absl::Now() - start, absl::FromChrono(kLongWait / 2));
  EXPECT_EQ(Stats().creates_waiting, 0);
  EXPECT_EQ(Stats().tensors, 1);  // only `full`
}

TEST_F(WaitCancelTest, DaemonInstanceAndSocket) {
  EXPECT_NE(client_->daemon_instance(), 0u);
  EXPECT_EQ(client_->socket(), daemon_->socket());
  tensorshm::StatusOr<std::shared_ptr<Client>> second =
      Client::Connect(ClientOptions{daemon_->socket(), "second"});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->daemon_instance(), client_->daemon_instance());
  EXPECT_NE((*second)->session_id(), client_->session_id());
}

// TryAcquireLocal (asyncio's aget calls it on the event loop's thread): the fast path's answer
// or none, never a call to the daemon or a wait.
TEST_F(WaitCancelTest, TryAcquireLocalAnswersFromTheFastPathOrNotAtAll) {
  TensorSpec spec;
  spec.dtype = DLDataType{kDLFloat, 32, 1};
  spec.shape = {16};
  tensorshm::StatusOr<WritableTensor> w = client_->Create(spec);
  ASSERT_TRUE(w.ok()) << w.status();
  static_cast<float*>(w->data())[3] = 42.0f;
  ASSERT_TRUE(client_->Publish(*w, "local").ok());

  tensorshm::StatusOr<DLManagedTensorVersioned*> local = client_->TryAcquireLocal("local");
  ASSERT_TRUE(local.ok()) << local.status();
  const DLTensor& t = (*local)->dl_tensor;
  EXPECT_EQ(static_cast<const float*>(t.data)[3], 42.0f);
  EXPECT_NE((*local)->flags & DLPACK_FLAG_BITMASK_READ_ONLY, 0u);
  EXPECT_EQ(Stats().leases, 1);  // a real lease, given back by its deleter
  (*local)->deleter(*local);
  EXPECT_EQ(Stats().leases, 0);

  tensorshm::StatusOr<DLManagedTensorVersioned*> missing = client_->TryAcquireLocal("missing");
  EXPECT_EQ(missing.status().code(), tensorshm::StatusCode::kNotFound) << missing.status();

  // With the daemon stopped the fast path cannot answer, and nothing goes to the (absent) daemon.
  daemon_->process().Kill(SIGTERM);
  ASSERT_TRUE(daemon_->process().Wait(absl::Seconds(30)).ok());
  tensorshm::StatusOr<DLManagedTensorVersioned*> gone = client_->TryAcquireLocal("local");
  EXPECT_EQ(gone.status().code(), tensorshm::StatusCode::kUnavailable) << gone.status();
  EXPECT_NE(gone.status().message().find("the fast path cannot answer"), std::string_view::npos)
      << gone.status();
}

}  // namespace
}  // namespace tensorshm::testing
