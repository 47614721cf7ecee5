// CUDA device pools end to end against the emulated driver (tests/support/fake_cuda): a real daemon
// with device pools, producer and consumer processes that see the devices in different orders, IPC
// handles opened once per segment and closed after the last tensor, ready events waited on.
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/fake_cuda/fake_cuda.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

// The machine has 3 devices; the daemon sees them in order and pools cuda:1 and cuda:2.
std::vector<std::string> DriverEnv(const std::string& visible) {
  return {"TENSORSHM_LIBCUDA=" + FakeCudaPath(), "TSM_FAKE_CUDA_DEVICES=3",
          "TSM_FAKE_CUDA_VISIBLE=" + visible};
}

// "key=value" words of the line starting with `label` in `output`.
std::map<std::string, int64_t> Counters(const std::string& output, const std::string& label) {
  std::map<std::string, int64_t> counters;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (!absl::StartsWith(line, label + " ")) continue;
    for (absl::string_view word : absl::StrSplit(line.substr(label.size() + 1), ' ')) {
      std::pair<std::string, std::string> kv = absl::StrSplit(word, '=');
      int64_t value = 0;
      if (absl::SimpleAtoi(kv.second, &value)) counters[kv.first] = value;
    }
  }
  return counters;
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    absl::StatusOr<TestDaemon> daemon =
        TestDaemon::Start(name.substr(0, 20),
                          {"--host-pool", "64Mi", "--cuda-pool", "cuda:1=64Mi", "--cuda-pool",
                           "cuda:2=16Mi", "--cuda-segment-size", "4Mi", "--log-level", "info"},
                          DriverEnv("0,1,2"));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    // This process is a client too, seeing the devices reversed.
    setenv("TENSORSHM_LIBCUDA", FakeCudaPath().c_str(), 1);
    setenv("TSM_FAKE_CUDA_DEVICES", "3", 1);
    setenv("TSM_FAKE_CUDA_VISIBLE", "2,1,0", 1);
    absl::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "cuda_test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();
    // Killed producers leave their emulated events' pages behind.
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      const std::string file = entry.path().filename().string();
      if (!absl::StartsWith(file, "tsmfakecu.")) continue;
      const pid_t pid = std::atoi(file.c_str() + strlen("tsmfakecu."));
      if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) std::filesystem::remove(entry.path());
    }
  }

  ChildProcess Peer(const std::vector<std::string>& args, const std::string& visible,
                    const std::string& log) {
    std::vector<std::string> argv = {PeerPath(), args.at(0), daemon_->socket()};
    argv.insert(argv.end(), args.begin() + 1, args.end());
    absl::StatusOr<ChildProcess> child =
        ChildProcess::Start(argv, daemon_->dir() + "/" + log, DriverEnv(visible));
    EXPECT_TRUE(child.ok());
    return *std::move(child);
  }

  static std::string Run(ChildProcess& peer) {
    absl::StatusOr<int> status = peer.Wait(absl::Seconds(60));
    EXPECT_TRUE(status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << peer.Output();
    return peer.Output();
  }

  PoolStats Pool(int type, int id) {
    absl::StatusOr<ServerStats> stats = client_->Stat();
    EXPECT_TRUE(stats.ok());
    for (const PoolStats& pool : stats->pools) {
      if (pool.device.device_type == type && pool.device.device_id == id) return pool;
    }
    ADD_FAILURE() << "no pool for device " << type << ":" << id;
    return {};
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
};

// A producer that numbers the devices 2,1,0 publishes on its cuda:0 (physical 2); a consumer that
// sees only 1,2 gets it as its cuda:1, byte-identical, opening the segment once for two acquires
// and closing it after its last tensor and its client are gone.
TEST_F(CudaTest, CrossProcessRoundTripUnderPermutedOrdinals) {
  EXPECT_EQ(Pool(kDLCUDA, 2).used_bytes, 0);
  ChildProcess producer = Peer({"cuda-produce", "gpu/x", "--device", "0", "--dtype", "float32",
                                "--shape", "64,1000", "--seed", "7"},
                               "2,1,0", "producer.log");
  ASSERT_TRUE(producer.WaitForOutput("published", absl::Seconds(30))) << producer.Output();
  // The daemon put it in its cuda:2 pool, 256-byte granular.
  EXPECT_EQ(Pool(kDLCUDA, 2).used_bytes, 256000);
  EXPECT_EQ(Pool(kDLCUDA, 1).used_bytes, 0);
  const std::map<std::string, int64_t> produced = Counters(producer.Output(), "counters");
  EXPECT_EQ(produced.at("event_record"), 1) << producer.Output();

  for (const bool on_stream : {false, true}) {
    SCOPED_TRACE(on_stream ? "stream wait" : "host wait");
    std::vector<std::string> args = {"cuda-consume", "gpu/x"};
    if (on_stream) args.push_back("--stream");
    ChildProcess consumer = Peer(args, "1,2", on_stream ? "stream.log" : "host.log");
    const std::string output = Run(consumer);
    EXPECT_EQ(Line(output, "checksum"), Line(producer.Output(), "checksum")) << output;
    EXPECT_TRUE(absl::StrContains(output, "device cuda:1 flags 1")) << output;
    const auto first = Counters(output, "first");
    const auto second = Counters(output, "second");
    const auto closed = Counters(output, "closed");
    ASSERT_FALSE(first.empty() || second.empty() || closed.empty()) << output;
    EXPECT_EQ(first.at("ipc_open_mappings"), 1);
    // The second acquire from the same segment opens no handle.
    EXPECT_EQ(second.at("ipc_open_calls"), 1);
    EXPECT_EQ(second.at("ipc_open_mappings"), 1);
    // Each acquire waited on the producer's recorded event, the way it was asked to.
    EXPECT_EQ(second.at("ipc_open_event"), 2);
    EXPECT_EQ(second.at("waits_on_recorded"), 2);
    EXPECT_EQ(second.at(on_stream ? "stream_wait_event" : "event_synchronize"), 2);
    EXPECT_EQ(second.at(on_stream ? "event_synchronize" : "stream_wait_event"), 0);
    // Handles stay open while tensors or the client live, and are closed after.
    EXPECT_EQ(Counters(output, "released").at("open_now"), 1);
    EXPECT_EQ(closed.at("open_now"), 0);
    EXPECT_EQ(closed.at("ipc_unmappings"), 1);
  }
  // Leases released; deleting frees the device buffer.
  absl::StatusOr<ServerStats> stats = client_->Stat();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->leases, 0);
  ASSERT_TRUE(client_->Delete("gpu/x").ok());
  EXPECT_EQ(Pool(kDLCUDA, 2).used_bytes, 0);
  producer.Kill(SIGTERM);
}

// In this process (devices seen as 2,1,0): create on each pooled device by this process's
// ordinal, publish, acquire back as kDLCUDA with the same ordinal; a device without a pool is
// refused naming its UUID.
TEST_F(CudaTest, CreatePublishAcquireInProcessByUuid) {
  // Physical 1 is ordinal 1 here, physical 2 is ordinal 0; physical 0 (ordinal 2) has no pool.
  for (const int ordinal : {0, 1}) {
    absl::StatusOr<WritableTensor> w =
        client_->Create({{kDLInt, 32, 1}, {10, 10}, {}, {kDLCUDA, ordinal}});
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->dl_tensor().device.device_type, kDLCUDA);
    EXPECT_EQ(w->dl_tensor().device.device_id, ordinal);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(w->dl_tensor().data) % 256, 0u);
    const std::string name = absl::StrCat("gpu/in-process-", ordinal);
    ASSERT_TRUE(client_->Publish(*w, name).ok());
    absl::StatusOr<DLManagedTensorVersioned*> t =
        client_->Acquire(name, absl::ZeroDuration(), ReadySync::None());
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->dl_tensor.device.device_type, kDLCUDA);
    EXPECT_EQ((*t)->dl_tensor.device.device_id, ordinal);
    EXPECT_TRUE(WaitReady(*t, ReadySync::Host()).ok());
    (*t)->deleter(*t);
  }
  EXPECT_EQ(Pool(kDLCUDA, 1).used_bytes, 512);
  EXPECT_EQ(Pool(kDLCUDA, 2).used_bytes, 512);
  absl::StatusOr<WritableTensor> none = client_->Create({{kDLInt, 32, 1}, {4}, {}, {kDLCUDA, 2}});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(none.status().message(), "device_uuid = GPU-")) << none.status();
  EXPECT_TRUE(absl::StrContains(none.status().message(), "--cuda-pool")) << none.status();
  absl::StatusOr<WritableTensor> bad = client_->Create({{kDLInt, 32, 1}, {4}, {}, {kDLCUDA, 7}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "cuda:7")) << bad.status();
  // Pool exhaustion names requested and free bytes.
  absl::StatusOr<WritableTensor> huge =
      client_->Create({{kDLUInt, 8, 1}, {32 << 20}, {}, {kDLCUDA, 0}});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "33554432 bytes")) << huge.status();
}

// A daemon whose CUDA pool cannot be made stops at start, saying why; without a driver the
// host-only service still works and CUDA requests are refused clearly.
TEST(CudaStartTest, NoDriverOrNoDeviceFailsAtStartWithTheReason) {
  const std::string dir = ::testing::TempDir();
  struct Case {
    std::vector<std::string> env;
    std::string device;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"TENSORSHM_LIBCUDA=/nonexistent/libcuda.so.1"}, "cuda:0=1Mi", "no CUDA driver"},
      {{"TENSORSHM_LIBCUDA=/nonexistent/libcuda.so.1"}, "cuda:0=1Mi", "TENSORSHM_LIBCUDA"},
      {DriverEnv("0,1"), "cuda:5=1Mi", "cuda:5: no such device"},
      {DriverEnv("0,1"), "cuda:5=1Mi", "sees 2 devices"},
      {{"TENSORSHM_LIBCUDA=" + FakeCudaPath(), "TSM_FAKE_CUDA_INIT_ERROR=1"},
       "cuda:0=1Mi",
       "CUDA_ERROR_NO_DEVICE"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].expected);
    absl::StatusOr<ChildProcess> daemon = ChildProcess::Start(
        {TensorShmdPath(), "--socket", absl::StrCat(dir, "/nodriver-", getpid(), ".sock"),
         "--host-pool", "4Mi", "--cuda-pool", cases[i].device},
        absl::StrCat(dir, "/nodriver-", getpid(), "-", i, ".log"), cases[i].env);
    ASSERT_TRUE(daemon.ok());
    absl::StatusOr<int> status = daemon->Wait(absl::Seconds(20));
    ASSERT_TRUE(status.ok());
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << daemon->Output();
    EXPECT_TRUE(absl::StrContains(daemon->Output(), cases[i].expected)) << daemon->Output();
    EXPECT_TRUE(absl::StrContains(daemon->Output(), "--cuda-pool cuda:")) << daemon->Output();
  }
}

TEST(CudaStartTest, WithoutADriverHostTensorsWorkAndCudaIsRefused) {
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
      "nodriver", {"--host-pool", "8Mi"}, {"TENSORSHM_LIBCUDA=/nonexistent/libcuda.so.1"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  setenv("TENSORSHM_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  absl::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon->socket(), "nodriver"});
  ASSERT_TRUE(client.ok());
  absl::StatusOr<WritableTensor> w = (*client)->Create({{kDLFloat, 32, 1}, {16}});
  ASSERT_TRUE(w.ok());
  static_cast<float*>(w->data())[3] = 2.5f;
  ASSERT_TRUE((*client)->Publish(*w, "host").ok());
  absl::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire("host");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(static_cast<const float*>((*t)->dl_tensor.data)[3], 2.5f);
  (*t)->deleter(*t);
  absl::StatusOr<WritableTensor> gpu =
      (*client)->Create({{kDLFloat, 32, 1}, {16}, {}, {kDLCUDA, 0}});
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(gpu.status().message(), "no CUDA driver")) << gpu.status();
}

}  // namespace
}  // namespace tensorshm::testing
