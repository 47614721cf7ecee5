// Full pools against a real tensorshmd: creates that wait for memory (Create with a timeout)
// and --evict lru. Producers that wait are tsm_pool_client processes; whether one waits is read
// from the daemon's state (Stat's creates_waiting, the child's output), never from the clock.
#include <signal.h>
#include <sys/wait.h>

#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tensorshm/tensorshm.h"
#include "tests/support/raw_session.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int64_t kMiB = 1 << 20;

std::string PoolClientPath() { return TSM_POOL_CLIENT_PATH; }

// Polls `condition` until it holds; false if it did not within `limit` (a bound for a hung
// test, not a measurement).
bool Eventually(const std::function<bool()>& condition, absl::Duration limit = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return condition();
}

class FullPoolTest : public ::testing::Test {
 protected:
  // A daemon whose host pool is one segment of 4 MiB.
  void StartDaemon(const std::vector<std::string>& extra = {}) {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::vector<std::string> args = {"--host-pool", "4Mi",         "--segment-size",
                                     "4Mi",         "--log-level", "info"};
    args.insert(args.end(), extra.begin(), extra.end());
    absl::StatusOr<TestDaemon> daemon =
        TestDaemon::Start(absl::StrCat("fp-", name.substr(0, 20)), args);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "full-pool-test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  ServerStats Stats() {
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : ServerStats{};
  }

  tensorshm::StatusOr<WritableTensor> Create(
      int64_t bytes, tensorshm::Duration timeout = tensorshm::Duration::zero()) {
    return client_->Create(TensorSpec{{kDLUInt, 8, 1}, {bytes}}, timeout);
  }

  // Publishes `bytes` bytes as `name` from this process.
  void Publish(const std::string& name, int64_t bytes) {
    tensorshm::StatusOr<WritableTensor> tensor = Create(bytes);
    ASSERT_TRUE(tensor.ok()) << name << ": " << tensor.status();
    ASSERT_TRUE(client_->Publish(*tensor, name).ok());
  }

  // A tsm_pool_client creating `bytes` bytes, waiting up to `timeout_ms`.
  ChildProcess StartCreate(int64_t bytes, int64_t timeout_ms, const std::string& tag,
                           const std::string& publish_as = "") {
    std::vector<std::string> argv = {PoolClientPath(), "create", daemon_->socket(),
                                     absl::StrCat(bytes), absl::StrCat(timeout_ms)};
    if (!publish_as.empty()) argv.push_back(publish_as);
    absl::StatusOr<ChildProcess> child =
        ChildProcess::Start(argv, absl::StrCat(daemon_->dir(), "/", tag, ".log"));
    EXPECT_TRUE(child.ok()) << child.status();
    return *std::move(child);
  }

  // Waits until `count` creates wait in the daemon.
  void ExpectWaiting(int64_t count) {
    EXPECT_TRUE(Eventually([&] { return Stats().creates_waiting == count; }))
        << "creates_waiting = " << Stats().creates_waiting << ", expected " << count;
  }

  static int ExitCode(ChildProcess& child) {
    absl::StatusOr<int> status = child.Wait(absl::Seconds(30));
    EXPECT_TRUE(status.ok()) << status.status();
    return status.ok() && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
};

// ---- Back-pressure ----

TEST_F(FullPoolTest, WaitingCreateIsServedWhenTheLastLeaseOfADeletedTensorEnds) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Publish("fill", 4 * kMiB);
  // A lease (this process's; the waiting producer is another) keeps the memory after the delete.
  tensorshm::StatusOr<DLManagedTensorVersioned*> lease = client_->Acquire("fill");
  ASSERT_TRUE(lease.ok()) << lease.status();

  ChildProcess producer = StartCreate(kMiB, 60'000, "producer", "made");
  ASSERT_TRUE(producer.WaitForOutput("connected", absl::Seconds(30))) << producer.Output();
  ExpectWaiting(1);
  ASSERT_TRUE(client_->Delete("fill").ok());
  // Unbound, but leased: nothing was freed, the create still waits.
  ASSERT_TRUE(client_->Flush().ok());
  EXPECT_EQ(Stats().creates_waiting, 1);
  EXPECT_EQ(Stats().pools[0].used_bytes, 4 * kMiB);
  EXPECT_FALSE(absl::StrContains(producer.Output(), "created")) << producer.Output();

  (*lease)->deleter(*lease);  // the lease ends: its memory is freed, the create is served
  ASSERT_TRUE(client_->Flush().ok());
  EXPECT_EQ(ExitCode(producer), 0) << producer.Output();
  EXPECT_TRUE(absl::StrContains(producer.Output(), "created\npublished")) << producer.Output();
  ServerStats stats = Stats();
  EXPECT_EQ(stats.creates_waiting, 0);
  EXPECT_EQ(stats.names, 1);
  EXPECT_EQ(stats.pools[0].used_bytes, kMiB);
  std::cout << "waiting create served after the lease ended: " << producer.Output();
}

TEST_F(FullPoolTest, WaitingCreateFailsResourceExhaustedWhenItsTimeoutPasses) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Publish("fill", 4 * kMiB);
  ChildProcess producer = StartCreate(kMiB, 300, "producer");
  EXPECT_EQ(ExitCode(producer), 3);
  const std::string output = producer.Output();
  std::cout << output;
  EXPECT_TRUE(absl::StrContains(output, "error 8 host pool: cannot allocate 1048576 bytes"))
      << output;
  EXPECT_TRUE(absl::StrContains(output, "for memory to be freed (wait_ms = 300)")) << output;
  EXPECT_TRUE(absl::StrContains(output, "host pool: 4194304 of 4194304 bytes used")) << output;
  EXPECT_EQ(Stats().creates_waiting, 0);
  EXPECT_EQ(Stats().tensors, 1);
}

TEST_F(FullPoolTest, TimeoutZeroFailsAtOnceAsBefore) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Publish("fill", 4 * kMiB);
  tensorshm::StatusOr<WritableTensor> refused = Create(kMiB);
  ASSERT_EQ(refused.status().code(), tensorshm::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_FALSE(absl::StrContains(refused.status().message(), "waited")) << refused.status();
  EXPECT_EQ(Stats().creates_waiting, 0);
  // A create that fits does not wait, whatever its timeout.
  ASSERT_TRUE(client_->Delete("fill").ok());
  tensorshm::StatusOr<WritableTensor> made = Create(kMiB, std::chrono::seconds(60));
  EXPECT_TRUE(made.ok()) << made.status();
}

TEST_F(FullPoolTest, WaitingCreatesAreServedInOrder) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Publish("b", kMiB);      // [0, 1 MiB)
  Publish("a", 2 * kMiB);  // [1, 3 MiB); 1 MiB stays free
  // Each publishes what it made, so that its memory stays taken after it exits.
  ChildProcess first = StartCreate(3 * kMiB, 60'000, "first", "first");
  ExpectWaiting(1);
  // 1 MiB would fit, but a create waits for this memory already: no barging in.
  tensorshm::StatusOr<WritableTensor> barging = Create(kMiB);
  ASSERT_EQ(barging.status().code(), tensorshm::StatusCode::kResourceExhausted) << barging.status();
  EXPECT_TRUE(absl::StrContains(barging.status().message(), "1 earlier create waits for memory"))
      << barging.status();
  ChildProcess second = StartCreate(kMiB / 2, 60'000, "second", "second");
  ExpectWaiting(2);
  ASSERT_TRUE(client_->Delete("a").ok());  // [1, 4 MiB) free: the first one's 3 MiB
  EXPECT_EQ(ExitCode(first), 0) << first.Output();
  ExpectWaiting(1);  // the second one: the first took what was freed
  EXPECT_FALSE(absl::StrContains(second.Output(), "created")) << second.Output();
  ASSERT_TRUE(client_->Delete("b").ok());
  EXPECT_EQ(ExitCode(second), 0) << second.Output();
  EXPECT_EQ(Stats().creates_waiting, 0);
}

// A create waiting for memory holds up no other request of its client: it waits on the memory
// channel, where the client's other threads send theirs meanwhile (a publish here).
TEST_F(FullPoolTest, AWaitingCreateHoldsUpNoOtherCallOfItsClient) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  tensorshm::StatusOr<WritableTensor> held = Create(kMiB);
  ASSERT_TRUE(held.ok()) << held.status();
  Publish("fill", 3 * kMiB);
  std::future<tensorshm::Status> waiting = std::async(std::launch::async, [&] {
    tensorshm::StatusOr<WritableTensor> t = Create(kMiB, std::chrono::seconds(60));
    return t.status();
  });
  ExpectWaiting(1);
  ASSERT_TRUE(client_->Publish(*held, "held").ok());
  EXPECT_EQ(waiting.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  EXPECT_EQ(Stats().creates_waiting, 1);
  ASSERT_TRUE(client_->Delete("fill").ok());
  const tensorshm::Status status = waiting.get();
  EXPECT_TRUE(status.ok()) << status;
}

// A waiting create rides through a daemon restart (it waits for the reconnect until its
// deadline); with no daemon coming back it ends at its deadline with the stopping daemon's answer.
TEST_F(FullPoolTest, ShutdownEndsAWaitingCreateAtItsDeadline) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Publish("fill", 4 * kMiB);
  ChildProcess producer = StartCreate(kMiB, 3000, "producer");
  ExpectWaiting(1);
  client_.reset();
  daemon_->process().Kill(SIGTERM);
  absl::StatusOr<int> daemon_status = daemon_->process().Wait(absl::Seconds(30));
  ASSERT_TRUE(daemon_status.ok()) << daemon_status.status();
  EXPECT_TRUE(WIFEXITED(*daemon_status) && WEXITSTATUS(*daemon_status) == 0) << *daemon_status;
  EXPECT_EQ(ExitCode(producer), 3);
  std::cout << producer.Output();
  EXPECT_TRUE(absl::StrContains(producer.Output(), "error 14 tensorshmd is stopping"))
      << producer.Output();
  EXPECT_EQ(daemon_->ShmObjectCount(), 0);
}

TEST_F(FullPoolTest, AProducerDyingWhileItsCreateWaitsLeavesNothingBehind) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Publish("fill", 4 * kMiB);
  const int64_t sessions = Stats().sessions;
  ChildProcess producer = StartCreate(kMiB, -1, "producer");
  ExpectWaiting(1);
  producer.Kill(SIGKILL);
  ExpectWaiting(0);
  EXPECT_TRUE(Eventually([&] { return Stats().sessions == sessions; }));
  ASSERT_TRUE(client_->Delete("fill").ok());
  ASSERT_TRUE(client_->Flush().ok());
  // Nothing was made for the dead producer once the memory came free.
  ServerStats stats = Stats();
  EXPECT_EQ(stats.tensors, 0);
  EXPECT_EQ(stats.pools[0].used_bytes, 0);
  EXPECT_EQ(stats.creates_waiting, 0);
}

TEST_F(FullPoolTest, CApiCreateWaitWaitsThenFailsResourceExhausted) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  Publish("fill", 4 * kMiB);
  tsm_client* c = nullptr;
  ASSERT_EQ(tsm_connect(daemon_->socket().c_str(), "c-api", &c), TSM_OK) << tsm_last_error();
  const int64_t shape[] = {kMiB};
  tsm_writable* out = nullptr;
  EXPECT_EQ(tsm_create_wait(c, DLDataType{kDLUInt, 8, 1}, 1, shape, nullptr, DLDevice{kDLCPU, 0},
                            -5, &out),
            TSM_INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(tsm_last_error(), "timeout_ms = -5")) << tsm_last_error();
  EXPECT_EQ(tsm_create_wait(c, DLDataType{kDLUInt, 8, 1}, 1, shape, nullptr, DLDevice{kDLCPU, 0},
                            100, &out),
            TSM_RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(tsm_last_error(), "(wait_ms = 100)")) << tsm_last_error();
  EXPECT_EQ(out, nullptr);
  tsm_client_free(c);
}

// ---- --evict lru ----

class EvictionTest : public FullPoolTest {
 protected:
  // An RPC lease on `name` from a session of its own, ended with the session: an acquire the
  // daemon sees, at a known point.
  void AcquireOnce(const std::string& name) {
    RawSession session(daemon_->socket(), "eviction-test");
    v1::AcquireRequest request;
    request.set_name(name);
    v1::AcquireResponse response;
    grpc::ClientContext context;
    session.Prepare(&context);
    grpc::Status status = session.stub().Acquire(&context, request, &response);
    ASSERT_TRUE(status.ok()) << name << ": " << status.error_message();
    session.Close();
  }

  std::vector<std::string> Names() {
    tensorshm::StatusOr<std::vector<TensorInfo>> list = client_->List();
    EXPECT_TRUE(list.ok()) << list.status();
    std::vector<std::string> names;
    if (list.ok()) {
      for (const TensorInfo& info : *list) names.push_back(info.name);
    }
    return names;
  }

  // The names in the daemon's "evicted" log lines, in order.
  std::vector<std::string> EvictedInLog() {
    std::vector<std::string> names;
    const std::string log = daemon_->process().Output();
    size_t at = 0;
    while ((at = log.find("evicted \"", at)) != std::string::npos) {
      at += 9;
      names.push_back(log.substr(at, log.find('"', at) - at));
    }
    return names;
  }

  // Four published tensors of 1 MiB fill the pool: t0..t3 at offsets 0..3 MiB.
  void FillWithFour() {
    for (int i = 0; i < 4; ++i) Publish(absl::StrCat("t", i), kMiB);
    ASSERT_EQ(Stats().pools[0].used_bytes, 4 * kMiB);
  }
};

TEST_F(EvictionTest, LeastRecentlyAcquiredGoFirstAndOnlyAsManyAsNeeded) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--evict", "lru"}));
  ASSERT_NO_FATAL_FAILURE(FillWithFour());
  for (const char* name : {"t1", "t2", "t0", "t3"}) AcquireOnce(name);
  // 2 MiB: t1 and t2 (the two least recently acquired, side by side) make room.
  tensorshm::StatusOr<WritableTensor> made = Create(2 * kMiB);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(EvictedInLog(), (std::vector<std::string>{"t1", "t2"}));
  EXPECT_EQ(Names(), (std::vector<std::string>{"t0", "t3"}));
  ServerStats stats = Stats();
  EXPECT_EQ(stats.evicted_tensors, 2);
  EXPECT_EQ(stats.evicted_bytes, 2 * kMiB);
  // An evicted name is gone as after a delete.
  tensorshm::StatusOr<DLManagedTensorVersioned*> gone = client_->Acquire("t1");
  EXPECT_EQ(gone.status().code(), tensorshm::StatusCode::kNotFound) << gone.status();
  const std::string log = daemon_->process().Output();
  const size_t line = log.rfind('\n', log.find("evicted \"t1\"")) + 1;
  std::cout << log.substr(line, log.find('\n', line) - line) << "\n";
}

TEST_F(EvictionTest, NeverAcquiredTensorsGoInPublishOrderBeforeAcquiredOnes) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--evict", "lru"}));
  ASSERT_NO_FATAL_FAILURE(FillWithFour());
  AcquireOnce("t0");
  AcquireOnce("t1");
  tensorshm::StatusOr<WritableTensor> made = Create(2 * kMiB);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(EvictedInLog(), (std::vector<std::string>{"t2", "t3"}));
  EXPECT_EQ(Names(), (std::vector<std::string>{"t0", "t1"}));
}

TEST_F(EvictionTest, LeasedTensorsAreNeverEvictedEvenWhenOldest) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--evict", "lru"}));
  ASSERT_NO_FATAL_FAILURE(FillWithFour());
  for (const char* name : {"t0", "t1", "t2", "t3"}) AcquireOnce(name);
  // t0, the oldest, under an RPC lease; t1, the next, under a fast path lease of another process.
  RawSession rpc_holder(daemon_->socket(), "rpc-holder");
  {
    v1::AcquireRequest request;
    request.set_name("t0");
    v1::AcquireResponse response;
    grpc::ClientContext context;
    rpc_holder.Prepare(&context);
    ASSERT_TRUE(rpc_holder.stub().Acquire(&context, request, &response).ok());
  }
  absl::StatusOr<ChildProcess> page_holder = ChildProcess::Start(
      {PeerPath(), "hold", daemon_->socket(), "t1"}, daemon_->dir() + "/holder.log");
  ASSERT_TRUE(page_holder.ok()) << page_holder.status();
  ASSERT_TRUE(page_holder->WaitForOutput("held", absl::Seconds(30))) << page_holder->Output();

  tensorshm::StatusOr<WritableTensor> made = Create(2 * kMiB);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(EvictedInLog(), (std::vector<std::string>{"t2", "t3"}));
  EXPECT_EQ(Names(), (std::vector<std::string>{"t0", "t1"}));

  // Nothing evictable is left: a create fails as without eviction ...
  tensorshm::StatusOr<WritableTensor> refused = Create(kMiB);
  ASSERT_EQ(refused.status().code(), tensorshm::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(Stats().evicted_tensors, 2);
  // ... or waits, until a lease ends and makes t1 evictable.
  ChildProcess producer = StartCreate(kMiB, 60'000, "producer");
  ExpectWaiting(1);
  EXPECT_EQ(Names(), (std::vector<std::string>{"t0", "t1"}));
  page_holder->Kill(SIGKILL);
  EXPECT_EQ(ExitCode(producer), 0) << producer.Output();
  EXPECT_EQ(EvictedInLog(), (std::vector<std::string>{"t2", "t3", "t1"}));
  EXPECT_EQ(Names(), (std::vector<std::string>{"t0"}));
  ServerStats stats = Stats();
  EXPECT_EQ(stats.evicted_tensors, 3);
  EXPECT_EQ(stats.evicted_bytes, 3 * kMiB);
}

TEST_F(EvictionTest, EvictNoneNeverEvicts) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--evict", "none"}));
  ASSERT_NO_FATAL_FAILURE(FillWithFour());
  for (const char* name : {"t1", "t2", "t0", "t3"}) AcquireOnce(name);
  tensorshm::StatusOr<WritableTensor> refused = Create(2 * kMiB);
  ASSERT_EQ(refused.status().code(), tensorshm::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(Names(), (std::vector<std::string>{"t0", "t1", "t2", "t3"}));
  EXPECT_TRUE(EvictedInLog().empty());
  EXPECT_EQ(Stats().evicted_tensors, 0);
  EXPECT_EQ(Stats().evicted_bytes, 0);
}

TEST_F(EvictionTest, NothingIsEvictedWhenEvictingEverythingWouldNotMakeRoom) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--evict", "lru"}));
  ASSERT_NO_FATAL_FAILURE(FillWithFour());
  tensorshm::StatusOr<WritableTensor> refused = Create(5 * kMiB);
  ASSERT_EQ(refused.status().code(), tensorshm::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(Stats().evicted_tensors, 0);
  EXPECT_EQ(Names().size(), 4u);
}

}  // namespace
}  // namespace tensorshm::testing
