// Integration tests: a real tensorshmd, real producer and consumer processes (tsm_peer,
// c_consumer), and this test process as one more client.
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/tensor_bytes.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

#define ASSERT_OK(x) ASSERT_TRUE((x).ok()) << (x).status()

struct PeerRun {
  int status = -1;  // raw wait status
  std::string output;
  bool exited_ok() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

class IntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    absl::StatusOr<TestDaemon> daemon =
        TestDaemon::Start(name.substr(0, 24), {"--host-pool", "256Mi", "--segment-size", "32Mi"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client = Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();
  }

  tensorshm::StatusOr<std::shared_ptr<Client>> Connect() {
    return Client::Connect(ClientOptions{daemon_->socket(), "integration_test"});
  }

  ChildProcess StartPeer(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {PeerPath(), args.at(0), daemon_->socket()};
    argv.insert(argv.end(), args.begin() + 1, args.end());
    const std::string log = absl::StrCat(daemon_->dir(), "/peer-", ++peer_count_, ".log");
    absl::StatusOr<ChildProcess> child = ChildProcess::Start(argv, log);
    TSM_CHECK(child.ok());
    return *std::move(child);
  }

  PeerRun RunPeer(const std::vector<std::string>& args) {
    ChildProcess child = StartPeer(args);
    PeerRun run;
    absl::StatusOr<int> status = child.Wait(absl::Seconds(60));
    run.status = status.ok() ? *status : -1;
    run.output = child.Output();
    return run;
  }

  ServerStats Stats() {
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : ServerStats{};
  }

  static int64_t Used(const ServerStats& stats) {
    return stats.pools.empty() ? -1 : stats.pools[0].used_bytes;
  }

  // Polls Stat until `done` holds (bounded; the daemon reclaims within milliseconds).
  bool WaitForStats(const std::function<bool(const ServerStats&)>& done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      if (done(Stats())) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
  int peer_count_ = 0;
};

struct RoundTripCase {
  const char* label;
  const char* dtype;
  const char* shape;
  const char* strides;
};

void PrintTo(const RoundTripCase& c, std::ostream* os) { *os << c.label; }

class RoundTripTest : public IntegrationTest,
                      public ::testing::WithParamInterface<RoundTripCase> {};

TEST_P(RoundTripTest, BytesIdenticalAcrossProcesses) {
  const RoundTripCase& c = GetParam();
  const std::string name = absl::StrCat("roundtrip/", c.label);
  PeerRun produced = RunPeer({"produce", name, "--dtype", c.dtype, "--shape", c.shape, "--strides",
                              c.strides, "--seed", "7"});
  ASSERT_TRUE(produced.exited_ok()) << produced.output;
  PeerRun consumed = RunPeer({"consume", name});
  ASSERT_TRUE(consumed.exited_ok()) << consumed.output;
  const std::string produced_sum = Line(produced.output, "checksum");
  ASSERT_FALSE(produced_sum.empty()) << produced.output;
  EXPECT_EQ(Line(consumed.output, "checksum"), produced_sum);

  // Same dtype, shape, strides and byte offset on both sides; the consumer's copy is read-only.
  std::vector<std::string> pmeta = absl::StrSplit(Line(produced.output, "meta"), ' ');
  std::vector<std::string> cmeta = absl::StrSplit(Line(consumed.output, "meta"), ' ');
  ASSERT_EQ(pmeta.size(), 5u);
  ASSERT_EQ(cmeta.size(), 5u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(cmeta[i], pmeta[i]) << "meta field " << i;
  EXPECT_EQ(cmeta[0], c.dtype);
  EXPECT_EQ(cmeta[4], std::to_string(DLPACK_FLAG_BITMASK_READ_ONLY));

  // The legacy and the C consumers see the same bytes.
  PeerRun legacy = RunPeer({"consume", name, "--legacy"});
  ASSERT_TRUE(legacy.exited_ok()) << legacy.output;
  EXPECT_EQ(Line(legacy.output, "checksum"), produced_sum);

  absl::StatusOr<ChildProcess> c_consumer = ChildProcess::Start(
      {CConsumerPath(), daemon_->socket(), name}, daemon_->dir() + "/c_consumer.log");
  ASSERT_OK(c_consumer);
  absl::StatusOr<int> c_status = c_consumer->Wait(absl::Seconds(30));
  ASSERT_TRUE(c_status.ok() && WIFEXITED(*c_status) && WEXITSTATUS(*c_status) == 0)
      << c_consumer->Output();
  const std::string storage_sum = produced_sum.substr(0, produced_sum.find(' '));
  EXPECT_EQ(Line(c_consumer->Output(), "checksum"), storage_sum);

  // Every lease went back when the consumers exited.
  EXPECT_TRUE(WaitForStats([](const ServerStats& s) { return s.leases == 0; }));
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, RoundTripTest,
    ::testing::Values(RoundTripCase{"f32_3d", "float32", "2,3,4", "-"},
                      RoundTripCase{"i8_vector", "int8", "1000", "-"},
                      RoundTripCase{"f64_0d", "float64", "", "-"},
                      RoundTripCase{"u16_empty", "uint16", "0,5", "-"},
                      RoundTripCase{"f32_fortran", "float32", "4,3", "1,4"},
                      RoundTripCase{"i32_negative_stride", "int32", "3,4", "-4,1"},
                      RoundTripCase{"i64_broadcast", "int64", "5,4", "0,1"},
                      RoundTripCase{"f32_sliced", "float32", "3,3", "8,2"},
                      RoundTripCase{"bf16", "bfloat16", "17", "-"},
                      RoundTripCase{"c128", "complex128", "3,3", "-"},
                      RoundTripCase{"bool", "bool", "7", "-"},
                      RoundTripCase{"f8_e4m3fn", "float8_e4m3fn", "33", "-"},
                      RoundTripCase{"f4_e2m1fn_packed", "float4_e2m1fn", "9", "-"},
                      RoundTripCase{"u8_1mib", "uint8", "1024,1024", "-"},
                      RoundTripCase{"f16_vector_lanes", "float16x4", "8", "-"}),
    [](const ::testing::TestParamInfo<RoundTripCase>& info) { return info.param.label; });

TEST_F(IntegrationTest, ConsumerWriteToAcquiredTensorFaults) {
  ASSERT_TRUE(RunPeer({"produce", "ro", "--dtype", "uint8", "--shape", "4096"}).exited_ok());
  PeerRun writer = RunPeer({"write", "ro"});
  ASSERT_TRUE(absl::StrContains(writer.output, "acquired")) << writer.output;
  EXPECT_FALSE(absl::StrContains(writer.output, "write succeeded")) << writer.output;
  if (absl::StrContains(writer.output, "Sanitizer: SEGV")) {
    // Under ASan or TSan the fault is reported by the sanitizer, which then exits non-zero.
    EXPECT_TRUE(absl::StrContains(writer.output, "caused by a WRITE memory access"));
    // It then exits non-zero, or aborts with abort_on_error=1.
    EXPECT_TRUE((WIFEXITED(writer.status) && WEXITSTATUS(writer.status) != 0) ||
                (WIFSIGNALED(writer.status) && WTERMSIG(writer.status) == SIGABRT));
  } else {
    ASSERT_TRUE(WIFSIGNALED(writer.status)) << writer.output;
    EXPECT_TRUE(WTERMSIG(writer.status) == SIGSEGV || WTERMSIG(writer.status) == SIGBUS)
        << "killed by " << WTERMSIG(writer.status);
  }
  // The bytes are unchanged and the dead writer's lease was reclaimed.
  PeerRun consumed = RunPeer({"consume", "ro"});
  PeerRun again = RunPeer({"consume", "ro"});
  EXPECT_EQ(Line(consumed.output, "checksum"), Line(again.output, "checksum"));
  EXPECT_TRUE(WaitForStats([](const ServerStats& s) { return s.leases == 0; }));
}

TEST_F(IntegrationTest, LeasesAndUsageReturnToBaselineAfterNormalExitAndSigkill) {
  const ServerStats baseline = Stats();
  EXPECT_EQ(baseline.leases, 0);
  EXPECT_EQ(baseline.tensors, 0);
  for (const char* name : {"a", "b", "c"}) {
    ASSERT_TRUE(
        RunPeer({"produce", name, "--dtype", "float32", "--shape", "256,1024"}).exited_ok());
  }
  const ServerStats published = Stats();
  EXPECT_EQ(published.tensors, 3);
  EXPECT_EQ(Used(published), Used(baseline) + 3 * 1024 * 1024);

  // A consumer that exits normally gives its lease back.
  ASSERT_TRUE(RunPeer({"consume", "a"}).exited_ok());
  EXPECT_TRUE(WaitForStats([](const ServerStats& s) { return s.leases == 0; }));

  // A consumer SIGKILLed while holding leases: they end with its session.
  ChildProcess holder = StartPeer({"hold", "a", "b", "c"});
  ASSERT_TRUE(holder.WaitForOutput("held", absl::Seconds(30))) << holder.Output();
  EXPECT_EQ(Stats().leases, 3);
  EXPECT_EQ(Stats().sessions, 2);  // the holder and this test
  // Deleting leased tensors unbinds them but keeps their memory while leased.
  for (const char* name : {"a", "b", "c"}) ASSERT_TRUE(client_->Delete(name).ok());
  EXPECT_EQ(Used(Stats()), Used(published));
  EXPECT_EQ(Stats().tensors, 3);
  holder.Kill(SIGKILL);
  ASSERT_TRUE(holder.Wait(absl::Seconds(10)).ok());
  EXPECT_TRUE(WaitForStats([&](const ServerStats& s) {
    return s.leases == 0 && s.tensors == 0 && s.sessions == 1 && Used(s) == Used(baseline);
  })) << "leases "
      << Stats().leases << ", used " << Used(Stats());
}

TEST_F(IntegrationTest, ProducerKilledBeforePublishFreesItsBuffer) {
  const ServerStats baseline = Stats();
  ChildProcess producer = StartPeer(
      {"produce", "never", "--dtype", "uint8", "--shape", "8388608", "--hang-before-publish"});
  ASSERT_TRUE(producer.WaitForOutput("created", absl::Seconds(30))) << producer.Output();
  EXPECT_EQ(Stats().tensors, 1);
  EXPECT_EQ(Used(Stats()), Used(baseline) + 8388608);
  producer.Kill(SIGKILL);
  ASSERT_TRUE(producer.Wait(absl::Seconds(10)).ok());
  EXPECT_TRUE(WaitForStats([&](const ServerStats& s) {
    return s.tensors == 0 && Used(s) == Used(baseline) && s.sessions == 1;
  }));
  EXPECT_FALSE(client_->Acquire("never").ok());
}

TEST_F(IntegrationTest, WritableTensorDroppedUnpublishedFreesItsBuffer) {
  const ServerStats baseline = Stats();
  {
    tensorshm::StatusOr<WritableTensor> w = client_->Create({{kDLFloat, 32, 1}, {1024, 1024}});
    ASSERT_OK(w);
    EXPECT_EQ(Used(Stats()), Used(baseline) + 4 * 1024 * 1024);
  }
  ASSERT_TRUE(client_->Flush().ok());
  EXPECT_EQ(Used(Stats()), Used(baseline));
  EXPECT_EQ(Stats().tensors, 0);
}

TEST_F(IntegrationTest, ReplaceRebindsAndOldTensorLivesForItsLeases) {
  PeerRun first =
      RunPeer({"produce", "model", "--dtype", "int32", "--shape", "1000", "--seed", "1"});
  ASSERT_TRUE(first.exited_ok()) << first.output;
  tensorshm::StatusOr<DLManagedTensorVersioned*> old = client_->Acquire("model");
  ASSERT_OK(old);
  const uint64_t old_sum = StorageHash((*old)->dl_tensor);
  const ServerStats before = Stats();

  PeerRun refused =
      RunPeer({"produce", "model", "--dtype", "int32", "--shape", "1000", "--seed", "2"});
  EXPECT_EQ(WEXITSTATUS(refused.status), 3);
  EXPECT_TRUE(absl::StartsWith(Line(refused.output, "error"),
                               std::to_string(static_cast<int>(absl::StatusCode::kAlreadyExists))))
      << refused.output;

  PeerRun replaced = RunPeer(
      {"produce", "model", "--dtype", "int32", "--shape", "1000", "--seed", "2", "--replace"});
  ASSERT_TRUE(replaced.exited_ok()) << replaced.output;
  PeerRun consumed = RunPeer({"consume", "model"});
  EXPECT_EQ(Line(consumed.output, "checksum"), Line(replaced.output, "checksum"));
  EXPECT_NE(Line(consumed.output, "checksum"), Line(first.output, "checksum"));

  // The old tensor is still ours, bytes untouched, and still holds its memory.
  EXPECT_EQ(StorageHash((*old)->dl_tensor), old_sum);
  EXPECT_EQ(Stats().tensors, 2);
  EXPECT_GT(Used(Stats()), Used(before));
  (*old)->deleter(*old);
  ASSERT_TRUE(client_->Flush().ok());
  EXPECT_EQ(Stats().tensors, 1);
  EXPECT_EQ(Used(Stats()), Used(before));
}

TEST_F(IntegrationTest, PublishAndAcquireHoldsWhatItPublished) {
  tensorshm::StatusOr<WritableTensor> w = client_->Create({{kDLInt, 16, 1}, {3, 7}});
  ASSERT_OK(w);
  for (int i = 0; i < 21; ++i) static_cast<int16_t*>(w->data())[i] = static_cast<int16_t>(i * 3);
  tensorshm::StatusOr<DLManagedTensorVersioned*> held = client_->PublishAndAcquire(*w, "pa");
  ASSERT_OK(held);
  EXPECT_EQ(Stats().leases, 1);
  EXPECT_TRUE((*held)->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
  EXPECT_EQ(static_cast<const int16_t*>((*held)->dl_tensor.data)[20], 60);
  // Another process replaces the name; the lease still holds the bytes published here.
  ASSERT_TRUE(
      RunPeer({"produce", "pa", "--dtype", "int16", "--shape", "3,7", "--replace"}).exited_ok());
  EXPECT_EQ(static_cast<const int16_t*>((*held)->dl_tensor.data)[20], 60);
  EXPECT_EQ(Stats().tensors, 2);
  (*held)->deleter(*held);
  ASSERT_TRUE(client_->Flush().ok());
  EXPECT_EQ(Stats().tensors, 1);
  EXPECT_EQ(Stats().leases, 0);
}

TEST_F(IntegrationTest, DeleteWhileLeasedKeepsBytesUntilLastRelease) {
  const ServerStats baseline = Stats();
  ASSERT_TRUE(RunPeer({"produce", "x", "--dtype", "float64", "--shape", "300,300"}).exited_ok());
  tensorshm::StatusOr<DLManagedTensorVersioned*> held = client_->Acquire("x");
  ASSERT_OK(held);
  const uint64_t sum = StorageHash((*held)->dl_tensor);
  ASSERT_TRUE(client_->Delete("x").ok());
  EXPECT_EQ(client_->Acquire("x").status().code(), tensorshm::StatusCode::kNotFound);
  EXPECT_EQ(client_->Delete("x").code(), absl::StatusCode::kNotFound);
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = client_->List();
  ASSERT_OK(listed);
  EXPECT_TRUE(listed->empty());
  // The name is free again while the old bytes are still leased.
  ASSERT_TRUE(RunPeer({"produce", "x", "--dtype", "float64", "--shape", "300,300", "--seed", "9"})
                  .exited_ok());
  EXPECT_EQ(StorageHash((*held)->dl_tensor), sum);
  EXPECT_EQ(Stats().tensors, 2);
  (*held)->deleter(*held);
  ASSERT_TRUE(client_->Flush().ok());
  EXPECT_EQ(Stats().tensors, 1);
  ASSERT_TRUE(client_->Delete("x").ok());
  EXPECT_EQ(Used(Stats()), Used(baseline));
}

TEST_F(IntegrationTest, AcquireWaitsForPublish) {
  ChildProcess consumer = StartPeer({"consume", "later", "--wait-ms", "30000"});
  // The consumer is waiting before the producer exists: asleep on the fast path's futex, or in
  // the daemon (a consumer whose fast path was not set up yet).
  bool waiting = false;
  for (int i = 0; i < 3000 && !waiting; ++i) {
    waiting = WaitUntilSleepingOnSharedFutex(consumer.pid(), absl::Milliseconds(10));
    tensorshm::StatusOr<std::vector<SessionInfo>> sessions = client_->Sessions();
    ASSERT_OK(sessions);
    for (const SessionInfo& session : *sessions) waiting |= session.waiting_acquires > 0;
  }
  ASSERT_TRUE(waiting) << consumer.Output();
  EXPECT_FALSE(consumer.Wait(absl::ZeroDuration()).ok());
  PeerRun produced = RunPeer({"produce", "later", "--dtype", "uint8", "--shape", "100"});
  ASSERT_TRUE(produced.exited_ok()) << produced.output;
  absl::StatusOr<int> status = consumer.Wait(absl::Seconds(30));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << consumer.Output();
  EXPECT_EQ(Line(consumer.Output(), "checksum"), Line(produced.output, "checksum"));
}

TEST_F(IntegrationTest, AcquireWaitTimesOutWithDeadlineExceeded) {
  tensorshm::StatusOr<DLManagedTensorVersioned*> t =
      client_->Acquire("absent", std::chrono::milliseconds(150));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDeadlineExceeded) << t.status();
  EXPECT_TRUE(absl::StrContains(t.status().message(), "absent")) << t.status();
  EXPECT_EQ(client_->Acquire("absent").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(IntegrationTest, TensorsOutliveTheirClient) {
  ASSERT_TRUE(RunPeer({"produce", "keep", "--dtype", "uint8", "--shape", "65536"}).exited_ok());
  tensorshm::StatusOr<std::shared_ptr<Client>> other = Connect();
  ASSERT_OK(other);
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*other)->Acquire("keep");
  ASSERT_OK(t);
  const uint64_t sum = StorageHash((*t)->dl_tensor);
  other->reset();  // the Client goes; the tensor and its session stay
  EXPECT_EQ(Stats().sessions, 2);
  EXPECT_EQ(Stats().leases, 1);
  EXPECT_EQ(StorageHash((*t)->dl_tensor), sum);
  // The deleter runs on another thread; then the session closes by itself.
  std::thread([&] { (*t)->deleter(*t); }).join();
  EXPECT_TRUE(WaitForStats([](const ServerStats& s) { return s.leases == 0 && s.sessions == 1; }));
}

TEST_F(IntegrationTest, ConcurrentDeletersFromManyThreads) {
  ASSERT_TRUE(RunPeer({"produce", "shared", "--dtype", "float32", "--shape", "64"}).exited_ok());
  std::vector<DLManagedTensorVersioned*> tensors;
  for (int i = 0; i < 200; ++i) {
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = client_->Acquire("shared");
    ASSERT_OK(t);
    tensors.push_back(*t);
  }
  EXPECT_EQ(Stats().leases, 200);
  std::vector<std::thread> threads;
  for (int k = 0; k < 8; ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = k; i < tensors.size(); i += 8) tensors[i]->deleter(tensors[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(client_->Flush().ok());
  EXPECT_EQ(Stats().leases, 0);
}

TEST_F(IntegrationTest, ListAndPoolGrowthAndExhaustion) {
  for (const char* name : {"batch/1", "batch/2", "other"}) {
    ASSERT_TRUE(RunPeer({"produce", name, "--dtype", "uint8", "--shape", "10"}).exited_ok());
  }
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = client_->List("batch/");
  ASSERT_OK(listed);
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].name, "batch/1");
  EXPECT_EQ((*listed)[1].name, "batch/2");
  EXPECT_EQ((*listed)[0].shape, std::vector<int64_t>{10});

  // 100 MiB does not fit a 32 MiB segment: the pool grows by a segment of its own.
  tensorshm::StatusOr<WritableTensor> big = client_->Create({{kDLUInt, 8, 1}, {100 << 20}});
  ASSERT_OK(big);
  std::memset(big->data(), 0xab, 100 << 20);
  ASSERT_TRUE(client_->Publish(*big, "big").ok());
  EXPECT_EQ(big->data(), nullptr);
  // 200 MiB more does not fit the 256 MiB pool.
  tensorshm::StatusOr<WritableTensor> too_big = client_->Create({{kDLUInt, 8, 1}, {200 << 20}});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(too_big.status().message(), "209715200")) << too_big.status();
  // The daemon serves on, and the big tensor reads back.
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = client_->Acquire("big");
  ASSERT_OK(t);
  const auto* bytes = static_cast<const unsigned char*>((*t)->dl_tensor.data);
  EXPECT_EQ(bytes[0], 0xab);
  EXPECT_EQ(bytes[(100 << 20) - 1], 0xab);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(bytes) % 256, 0u);
  (*t)->deleter(*t);
}

TEST_F(IntegrationTest, SigtermRemovesSocketAndSegmentsAndExitsZero) {
  ASSERT_TRUE(RunPeer({"produce", "t", "--dtype", "uint8", "--shape", "10"}).exited_ok());
  EXPECT_GE(daemon_->ShmObjectCount(), 2);  // control segment + a pool segment
  client_.reset();
  daemon_->process().Kill(SIGTERM);
  absl::StatusOr<int> status = daemon_->process().Wait(absl::Seconds(15));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
  EXPECT_EQ(daemon_->ShmObjectCount(), 0);
  EXPECT_FALSE(std::filesystem::exists(daemon_->socket()));
}

TEST_F(IntegrationTest, SigtermWithConnectedClientsStillExitsZero) {
  ASSERT_TRUE(RunPeer({"produce", "t", "--dtype", "uint8", "--shape", "10"}).exited_ok());
  ChildProcess holder = StartPeer({"hold", "t"});
  ASSERT_TRUE(holder.WaitForOutput("held\n", absl::Seconds(30))) << holder.Output();
  daemon_->process().Kill(SIGINT);
  absl::StatusOr<int> status = daemon_->process().Wait(absl::Seconds(15));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
  EXPECT_EQ(daemon_->ShmObjectCount(), 0);
}

TEST_F(IntegrationTest, HealthServiceReportsServing) {
  grpc::GenericStub stub(
      grpc::CreateChannel("unix:" + daemon_->socket(), grpc::InsecureChannelCredentials()));
  grpc::Slice empty;
  grpc::ByteBuffer request(&empty, 1);  // HealthCheckRequest{service: ""}
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status status) { done.set_value(status); });
  grpc::Status status = done.get_future().get();
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));  // HealthCheckResponse{status: SERVING}
}

// Lines of /proc/self/maps that map one of the daemon's pool segments.
int PoolMappings(const std::string& prefix) {
  std::ifstream maps("/proc/self/maps");
  int count = 0;
  for (std::string line; std::getline(maps, line);) {
    if (absl::StrContains(line, "/dev/shm/" + prefix + ".cpu.")) ++count;
  }
  return count;
}

TEST_F(IntegrationTest, ConsumerMapsEachSegmentOnceReadOnly) {
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(RunPeer({"produce", absl::StrCat("m/", i), "--dtype", "float32", "--shape", "1000"})
                    .exited_ok());
  }
  EXPECT_EQ(PoolMappings(daemon_->shm_prefix()), 0);
  std::vector<DLManagedTensorVersioned*> held;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 5; ++i) {
      tensorshm::StatusOr<DLManagedTensorVersioned*> t = client_->Acquire(absl::StrCat("m/", i));
      ASSERT_OK(t);
      held.push_back(*t);
    }
  }
  // Fifteen tensors from one segment: one mapping, and it is not writable.
  EXPECT_EQ(PoolMappings(daemon_->shm_prefix()), 1);
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (absl::StrContains(line, daemon_->shm_prefix() + ".cpu.")) {
      EXPECT_EQ(line.substr(line.find(' ') + 1, 4), "r--s") << line;
    }
  }
  // The tensors are distinct, 256-byte aligned views into it.
  EXPECT_NE(held[0]->dl_tensor.data, held[1]->dl_tensor.data);
  for (DLManagedTensorVersioned* t : held) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->dl_tensor.data) % 256, 0u);
    t->deleter(t);
  }
  ASSERT_TRUE(client_->Flush().ok());
  EXPECT_EQ(Stats().leases, 0);
}

// The producer maps its uid's segment writable once, whole, and keeps that mapping across
// tensors and publishes: a buffer handed out again costs no mmap (and no page faults).
TEST_F(IntegrationTest, ProducerKeepsOneWritableMappingOfTheSegmentAcrossTensors) {
  auto writable_mappings = [this](uintptr_t* length) {
    std::ifstream maps("/proc/self/maps");
    int writable = 0;
    for (std::string line; std::getline(maps, line);) {
      if (!absl::StrContains(line, daemon_->shm_prefix() + ".cpu.")) continue;
      if (line.substr(line.find(' ') + 1, 4) != "rw-s") continue;
      ++writable;
      const uintptr_t start = std::stoull(line.substr(0, line.find('-')), nullptr, 16);
      const uintptr_t end = std::stoull(line.substr(line.find('-') + 1), nullptr, 16);
      *length = end - start;
    }
    return writable;
  };
  uintptr_t length = 0;
  for (int i = 0; i < 3; ++i) {
    tensorshm::StatusOr<WritableTensor> w = client_->Create({{kDLUInt, 8, 1}, {10000}});
    ASSERT_OK(w);
    EXPECT_EQ(writable_mappings(&length), 1);
    EXPECT_EQ(length, 32u << 20);  // the whole segment, not the page-rounded buffer
    ASSERT_TRUE(client_->Publish(*w, absl::StrCat("sealed/", i)).ok());
    EXPECT_EQ(writable_mappings(&length), 1);  // kept past the publish, for the next buffer
  }
}

TEST(DaemonStartTest, SmallOrFullDevShmIsAClearErrorAtStartAndAtCreate) {
  // A private mount namespace with a 16 MiB /dev/shm stands in for a small or full one.
  if (geteuid() != 0) {
    GTEST_SKIP() << "needs root to create a mount namespace (unshare); the small-/dev/shm paths "
                    "are not exercised";
  }
  // As root a mount namespace must be possible: a failure here is the test's, not a skip.
  ASSERT_EQ(std::system("unshare --mount --propagation private /bin/sh -c "
                        "'mount -t tmpfs -o size=1m tmpfs /dev/shm' >/dev/null 2>&1"),
            0)
      << "unshare --mount failed as root (util-linux's unshare, CAP_SYS_ADMIN)";
  const std::string dir =
      std::filesystem::temp_directory_path().string() + absl::StrCat("/tsmtest-fullshm-", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // `fill_mib` of /dev/shm is taken by something else before the daemon starts.
  auto small_shm = [&](int fill_mib, const std::string& flags) {
    return std::vector<std::string>{
        "/usr/bin/unshare",
        "--mount",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        absl::StrCat("mount -t tmpfs -o size=16m tmpfs /dev/shm && ",
                     "dd if=/dev/zero of=/dev/shm/other bs=1M count=", fill_mib,
                     " status=none && exec ", TensorShmdPath(), " --socket ", dir,
                     "/s.sock --max-tensors 64 --log-level warning ", flags)};
  };
  // At start: a pool larger than /dev/shm is refused with the sizes and the fix.
  absl::StatusOr<ChildProcess> daemon =
      ChildProcess::Start(small_shm(0, "--host-pool 64Mi --segment-size 16Mi"), dir + "/a.log");
  ASSERT_OK(daemon);
  absl::StatusOr<int> status = daemon->Wait(absl::Seconds(15));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << daemon->Output();
  for (const char* expected :
       {"--host-pool = 67108864 bytes", "holds 16777216 bytes", "--shm-size", "sizeLimit"}) {
    EXPECT_TRUE(absl::StrContains(daemon->Output(), expected)) << daemon->Output();
  }

  // At create: the pool fits /dev/shm, but 10 of its 16 MiB are taken by someone else.
  daemon =
      ChildProcess::Start(small_shm(10, "--host-pool 12Mi --segment-size 4Mi"), dir + "/b.log");
  ASSERT_OK(daemon);
  ASSERT_TRUE(daemon->WaitForOutput("serving on", absl::Seconds(15))) << daemon->Output();
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{dir + "/s.sock", "fullshm"});
  ASSERT_OK(client);
  tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLUInt, 8, 1}, {6 << 20}});
  EXPECT_EQ(w.status().code(), absl::StatusCode::kResourceExhausted) << w.status();
  EXPECT_TRUE(absl::StrContains(w.status().message(), "/dev/shm has no room")) << w.status();
  tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->pools.at(0).used_bytes, 0);
  client->reset();
  daemon->Kill(SIGTERM);
  status = daemon->Wait(absl::Seconds(15));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << daemon->Output();
  std::filesystem::remove_all(dir);
}

TEST(DaemonStartTest, SessionQuotaBoundsUnpublishedBytes) {
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("quota", {"--host-pool", "64Mi", "--session-quota", "1Mi"});
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> c =
      Client::Connect(ClientOptions{daemon->socket(), "quota"});
  ASSERT_OK(c);
  tensorshm::StatusOr<WritableTensor> a = (*c)->Create({{kDLUInt, 8, 1}, {600 << 10}});
  ASSERT_OK(a);
  tensorshm::StatusOr<WritableTensor> b = (*c)->Create({{kDLUInt, 8, 1}, {600 << 10}});
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(b.status().message(), "quota 1048576 bytes")) << b.status();
  // Another session has a quota of its own; publishing gives this one's back.
  tensorshm::StatusOr<std::shared_ptr<Client>> other =
      Client::Connect(ClientOptions{daemon->socket(), "quota-other"});
  ASSERT_OK(other);
  EXPECT_TRUE((*other)->Create({{kDLUInt, 8, 1}, {600 << 10}}).ok());
  ASSERT_TRUE((*c)->Publish(*a, "q").ok());
  EXPECT_TRUE((*c)->Create({{kDLUInt, 8, 1}, {600 << 10}}).ok());
}

// Runs tsm_peer as `uid` (needs root to drop to it); returns its wait status and output.
std::pair<int, std::string> RunPeerAs(const TestDaemon& daemon, int uid,
                                      const std::vector<std::string>& args) {
  std::vector<std::string> argv = {PeerPath(), args.at(0), daemon.socket()};
  argv.insert(argv.end(), args.begin() + 1, args.end());
  argv.insert(argv.end(), {"--as-uid", std::to_string(uid)});
  absl::StatusOr<ChildProcess> child =
      ChildProcess::Start(argv, daemon.dir() + "/as-" + std::to_string(uid) + "-" + args[0]);
  TSM_CHECK(child.ok());
  absl::StatusOr<int> status = child->Wait(absl::Seconds(30));
  return {status.ok() ? *status : -1, child->Output()};
}

constexpr int kNobody = 65534;

TEST(AccessTest, AnotherUidIsRefusedWithPermissionDenied) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start("access-default");
  ASSERT_OK(daemon);
  // The socket and its directory let other users reach the daemon, which then refuses them.
  chmod(daemon->dir().c_str(), 0755);
  chmod(daemon->socket().c_str(), 0666);
  auto [status, output] = RunPeerAs(*daemon, kNobody, {"stat"});
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << output;
  EXPECT_TRUE(absl::StrContains(output, "error 7 ")) << output;  // PERMISSION_DENIED
  EXPECT_TRUE(absl::StrContains(output, "uid 65534")) << output;
  EXPECT_TRUE(absl::StrContains(output, "--allow-uid")) << output;
  // The daemon's own uid is served as before.
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  EXPECT_TRUE((*own)->Stat().ok());
}

TEST(AccessTest, AllowedUidReadsButMayNotDeleteOthersTensors) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("access-allow", {"--allow-uid", std::to_string(kNobody)});
  ASSERT_OK(daemon);
  chmod(daemon->dir().c_str(), 0755);
  struct stat st;
  ASSERT_EQ(stat(daemon->socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666u);  // shared socket: credentials decide
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  tensorshm::StatusOr<WritableTensor> w = (*own)->Create({{kDLInt, 32, 1}, {64}});
  ASSERT_OK(w);
  for (int i = 0; i < 64; ++i) static_cast<int32_t*>(w->data())[i] = i;
  ASSERT_TRUE((*own)->Publish(*w, "owned").ok());

  auto [read_status, read_output] = RunPeerAs(*daemon, kNobody, {"consume", "owned"});
  EXPECT_TRUE(WIFEXITED(read_status) && WEXITSTATUS(read_status) == 0) << read_output;
  EXPECT_TRUE(absl::StrContains(read_output, "meta int32 [64]")) << read_output;
  auto [delete_status, delete_output] = RunPeerAs(*daemon, kNobody, {"delete", "owned"});
  EXPECT_TRUE(absl::StrContains(delete_output, "error 7 ")) << delete_output;
  EXPECT_TRUE(absl::StrContains(delete_output, "published by uid 0")) << delete_output;
  tensorshm::StatusOr<DLManagedTensorVersioned*> still = (*own)->Acquire("owned");
  ASSERT_OK(still);  // still there
  (*still)->deleter(*still);
}

// With --allow-uid, segments stay private (0600): the other uid gets descriptors over the
// memory channel, writable ones only for segments holding its own buffers. So it can produce,
// its buffers come zeroed, and it cannot write the daemon uid's sealed tensors.
TEST(AccessTest, AllowedUidProducesInItsOwnSegmentsAndEverySegmentIsPrivate) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
      "access-own", {"--allow-uid", std::to_string(kNobody), "--segment-size", "4Mi"});
  ASSERT_OK(daemon);
  chmod(daemon->dir().c_str(), 0755);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  tensorshm::StatusOr<WritableTensor> w = (*own)->Create({{kDLUInt, 8, 1}, {8192}});
  ASSERT_OK(w);
  std::memset(w->data(), 0x33, 8192);
  ASSERT_TRUE((*own)->Publish(*w, "owned").ok());

  auto [produce_status, produced] =
      RunPeerAs(*daemon, kNobody,
                {"produce", "theirs", "--dtype", "uint8", "--shape", "65536", "--seed", "3"});
  ASSERT_TRUE(WIFEXITED(produce_status) && WEXITSTATUS(produce_status) == 0) << produced;
  auto [consume_status, consumed] = RunPeerAs(*daemon, kNobody, {"consume", "theirs"});
  EXPECT_TRUE(WIFEXITED(consume_status) && WEXITSTATUS(consume_status) == 0) << consumed;
  EXPECT_EQ(Line(consumed, "checksum"), Line(produced, "checksum"));
  tensorshm::StatusOr<DLManagedTensorVersioned*> theirs = (*own)->Acquire("theirs");
  ASSERT_OK(theirs);
  EXPECT_TRUE(absl::StartsWith(Line(produced, "checksum"),
                               absl::StrCat(StorageHash((*theirs)->dl_tensor), " ")));
  (*theirs)->deleter(*theirs);

  // The daemon uid's sealed tensor: readable, never writable.
  auto [read_status, read_output] = RunPeerAs(*daemon, kNobody, {"consume", "owned"});
  EXPECT_TRUE(WIFEXITED(read_status) && WEXITSTATUS(read_status) == 0) << read_output;
  auto [escalate_status, escalated] = RunPeerAs(*daemon, kNobody, {"escalate", "owned"});
  EXPECT_TRUE(absl::StrContains(escalated, "mprotect EACCES")) << escalated;
  auto [write_status, written] = RunPeerAs(*daemon, kNobody, {"write", "owned"});
  EXPECT_TRUE(absl::StrContains(written, "acquired")) << written;
  EXPECT_FALSE(absl::StrContains(written, "write succeeded")) << written;
  tensorshm::StatusOr<DLManagedTensorVersioned*> still = (*own)->Acquire("owned");
  ASSERT_OK(still);
  const auto* bytes = static_cast<const unsigned char*>((*still)->dl_tensor.data);
  EXPECT_TRUE(std::all_of(bytes, bytes + 8192, [](unsigned char b) { return b == 0x33; }));
  (*still)->deleter(*still);

  // On a raw channel of its own session it gets no writable descriptor of the daemon uid's
  // segment, and its read-only one cannot be reopened for writing.
  auto [probe_status, probed] = RunPeerAs(*daemon, kNobody, {"probe-channel"});
  EXPECT_TRUE(absl::StrContains(probed, "bind: code 0")) << probed;
  EXPECT_TRUE(absl::StrContains(probed, "writable 1: code 7 segment.writable")) << probed;
  EXPECT_TRUE(absl::StrContains(probed, "readable 1: code 0")) << probed;
  EXPECT_TRUE(absl::StrContains(probed, "reopen rw: EACCES")) << probed;

  // A buffer the other uid gets again after freeing it holds zeros or its own leftovers, never
  // a byte of the daemon uid's tensors (0x33 above).
  auto [reuse_status, reused] =
      RunPeerAs(*daemon, kNobody, {"reuse", "scratch", "--shape", "1048576"});
  EXPECT_TRUE(absl::StrContains(reused, "reused foreign 0")) << reused;

  // Every object the daemon made is its own and private, whoever is admitted. The other uid's
  // buffers took a segment of their own, a memfd (sealed against resizing): not in /dev/shm.
  int memfds = 0;
  for (const auto& entry : std::filesystem::directory_iterator(
           absl::StrCat("/proc/", daemon->process().pid(), "/fd"))) {
    std::error_code error;
    const std::string target = std::filesystem::read_symlink(entry.path(), error).string();
    if (absl::StartsWith(target, absl::StrCat("/memfd:", daemon->shm_prefix(), ".cpu."))) {
      ++memfds;
    }
  }
  EXPECT_EQ(memfds, 1);
  int objects = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (!absl::StartsWith(entry.path().filename().string(), daemon->shm_prefix() + ".")) continue;
    struct stat st;
    ASSERT_EQ(stat(entry.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << entry.path();
    EXPECT_EQ(st.st_uid, 0u) << entry.path();
    ++objects;
  }
  EXPECT_EQ(objects, 3);  // the prefix's lock file, the catalog and the daemon uid's segment
}

TEST(DaemonStartTest, RefusesASecondDaemonOnTheSameSocket) {
  absl::StatusOr<TestDaemon> first = TestDaemon::Start("second");
  ASSERT_OK(first);
  absl::StatusOr<ChildProcess> second = ChildProcess::Start(
      {TensorShmdPath(), "--socket", first->socket()}, first->dir() + "/second.log");
  ASSERT_OK(second);
  absl::StatusOr<int> status = second->Wait(absl::Seconds(15));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0);
  EXPECT_TRUE(absl::StrContains(second->Output(), "another tensorshmd")) << second->Output();
}

TEST(DaemonStartTest, BadFlagsNameTheFlag) {
  const std::string log = std::filesystem::temp_directory_path().string() + "/tsm-badflag.log";
  absl::StatusOr<ChildProcess> daemon =
      ChildProcess::Start({TensorShmdPath(), "--host-pool", "12Q"}, log);
  ASSERT_OK(daemon);
  absl::StatusOr<int> status = daemon->Wait(absl::Seconds(15));
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(WEXITSTATUS(*status), 2);
  EXPECT_TRUE(absl::StrContains(daemon->Output(), "--host-pool = \"12Q\"")) << daemon->Output();
}

TEST(DaemonStartTest, ConnectWithoutDaemonIsUnavailable) {
  ClientOptions options;
  options.socket = "/tmp/tensorshm-test-nobody-here.sock";
  options.connect_timeout = std::chrono::milliseconds(200);
  tensorshm::StatusOr<std::shared_ptr<Client>> client = Client::Connect(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(client.status().message(), options.socket));
}

}  // namespace
}  // namespace tensorshm::testing
