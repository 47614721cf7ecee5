// Client::Flush drains every release and abandon queued before it, however many batches that
// takes (a batch carries at most 4096 ids of each kind). A real daemon, this process the client.
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

// More than three full batches of each kind.
constexpr int kMaxBatch = 4096;
constexpr int kQueued = 3 * kMaxBatch + 500;
// Leases beyond the session's lease page (512 slots, released by a store) go through the RPC
// and are released in batches.
constexpr int kPageSlots = 512;

// True while thread `tid` of this process blocks in a futex wait (Flush waiting for acks).
bool InFutexWait(pid_t tid) {
  if (tid == 0) return false;
  std::ifstream in(absl::StrCat("/proc/self/task/", tid, "/syscall"));
  std::string number;
  return static_cast<bool>(in >> number) && number == std::to_string(SYS_futex);
}

class FlushTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TestDaemon> daemon =
        TestDaemon::Start("flush", {"--host-pool", "64Mi", "--max-tensors", "32768"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "flush_test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
  }

  ServerStats Stats() {
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : ServerStats{};
  }

  // Runs `queue` (which queues releases or abandons) while the daemon is stopped (SIGSTOP), so
  // that the queue builds up behind the one batch in flight, then Flushes while the daemon
  // resumes.
  tensorshm::Status QueueWhileStoppedThenFlush(const std::function<void()>& queue) {
    const pid_t daemon = daemon_->process().pid();
    kill(daemon, SIGSTOP);
    queue();
    std::atomic<pid_t> flusher{0};
    std::future<tensorshm::Status> flushed = std::async(std::launch::async, [&] {
      flusher.store(static_cast<pid_t>(syscall(SYS_gettid)));
      return client_->Flush();
    });
    // Flush must wait for batches still queued: the daemon resumes only once Flush sleeps (it
    // cannot finish while the daemon is stopped).
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!InFutexWait(flusher.load()) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    const bool slept = InFutexWait(flusher.load());
    kill(daemon, SIGCONT);
    EXPECT_TRUE(slept) << "Flush never waited while the daemon was stopped";
    EXPECT_EQ(flushed.wait_for(std::chrono::seconds(60)), std::future_status::ready);
    return flushed.get();
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
};

TEST_F(FlushTest, DrainsEveryQueuedReleaseBatch) {
  tensorshm::StatusOr<WritableTensor> w = client_->Create({{kDLFloat, 32, 1}, {16}});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(client_->Publish(*w, "flush/t").ok());
  const int64_t baseline = Stats().leases;
  std::vector<DLManagedTensorVersioned*> held;
  for (int i = 0; i < kPageSlots + kQueued; ++i) {
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = client_->Acquire("flush/t");
    ASSERT_TRUE(t.ok()) << "acquire " << i << ": " << t.status();
    held.push_back(*t);
  }
  EXPECT_EQ(Stats().leases, baseline + kPageSlots + kQueued);
  const tensorshm::Status flushed = QueueWhileStoppedThenFlush([&] {
    for (DLManagedTensorVersioned* t : held) t->deleter(t);
  });
  ASSERT_TRUE(flushed.ok()) << flushed;
  const ServerStats after = Stats();
  std::cout << "leases: " << baseline + kPageSlots + kQueued << " held, " << after.leases
            << " after releasing them all and one Flush (baseline " << baseline << ")\n";
  EXPECT_EQ(after.leases, baseline);
}

TEST_F(FlushTest, DrainsEveryQueuedAbandonBatch) {
  const int64_t baseline = Stats().tensors;
  std::vector<WritableTensor> unpublished;
  for (int i = 0; i < kQueued; ++i) {
    // Empty tensors: a record each, no buffer.
    tensorshm::StatusOr<WritableTensor> w = client_->Create({{kDLUInt, 8, 1}, {0}});
    ASSERT_TRUE(w.ok()) << "create " << i << ": " << w.status();
    unpublished.push_back(*std::move(w));
  }
  EXPECT_EQ(Stats().tensors, baseline + kQueued);
  const tensorshm::Status flushed = QueueWhileStoppedThenFlush([&] { unpublished.clear(); });
  ASSERT_TRUE(flushed.ok()) << flushed;
  const ServerStats after = Stats();
  std::cout << "tensors: " << baseline + kQueued << " unpublished, " << after.tensors
            << " after dropping them all and one Flush (baseline " << baseline << ")\n";
  EXPECT_EQ(after.tensors, baseline);
}

}  // namespace
}  // namespace tensorshm::testing
