// CUDA device pools end to end against the emulated driver (tests/support/fake_cuda): a real daemon
// with device pools of each kind (VMM, legacy IPC), producer and consumer processes that see the
// devices in different orders, segments mapped once and unmapped after the last tensor, ready
// events waited on, consumers' mappings read-only.
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cuda/cuda_driver.h"
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

// The parameter: --cuda-pool-kind.
class CudaTest : public ::testing::TestWithParam<std::string> {
 protected:
  bool vmm() const { return GetParam() == "vmm"; }

  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
        absl::StrCat(name.substr(0, 16), "-", GetParam()),
        {"--host-pool", "64Mi", "--cuda-pool", "cuda:1=64Mi", "--cuda-pool", "cuda:2=16Mi",
         "--cuda-segment-size", "4Mi", "--cuda-pool-kind", GetParam(), "--log-level", "info"},
        DriverEnv("0,1,2"));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    // This process is a client too, seeing the devices reversed.
    setenv("TENSORSHM_LIBCUDA", FakeCudaPath().c_str(), 1);
    setenv("TSM_FAKE_CUDA_DEVICES", "3", 1);
    setenv("TSM_FAKE_CUDA_VISIBLE", "2,1,0", 1);
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "cuda_test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();
    RemoveDeadProcessesFakeCudaPages();  // killed producers leave their events' pages
  }

  // `extra_env` is added to the driver's environment.
  ChildProcess Peer(const std::vector<std::string>& args, const std::string& visible,
                    const std::string& log, const std::vector<std::string>& extra_env = {}) {
    std::vector<std::string> argv = {PeerPath(), args.at(0), daemon_->socket()};
    argv.insert(argv.end(), args.begin() + 1, args.end());
    std::vector<std::string> env = DriverEnv(visible);
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    absl::StatusOr<ChildProcess> child = ChildProcess::Start(argv, daemon_->dir() + "/" + log, env);
    EXPECT_TRUE(child.ok());
    return *std::move(child);
  }

  static std::string Run(ChildProcess& peer) {
    absl::StatusOr<int> status = peer.Wait(absl::Seconds(60));
    EXPECT_TRUE(status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << peer.Output();
    return peer.Output();
  }

  PoolStats Pool(int type, int id) {
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
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
TEST_P(CudaTest, CrossProcessRoundTripUnderPermutedOrdinals) {
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
    // Its emulated GPU reports the producer's event unfinished, so that it waits as asked
    // instead of finding it done.
    ChildProcess consumer = Peer(args, "1,2", on_stream ? "stream.log" : "host.log",
                                 {"TSM_FAKE_CUDA_BUSY_QUERIES=1000000"});
    const std::string output = Run(consumer);
    EXPECT_EQ(Line(output, "checksum"), Line(producer.Output(), "checksum")) << output;
    EXPECT_TRUE(absl::StrContains(output, "device cuda:1 flags 1")) << output;
    const auto first = Counters(output, "first");
    const auto second = Counters(output, "second");
    const auto closed = Counters(output, "closed");
    ASSERT_FALSE(first.empty() || second.empty() || closed.empty()) << output;
    if (vmm()) {
      // The segment's descriptor came over the memory channel, imported once for both acquires.
      EXPECT_EQ(first.at("vmm_import"), 1);
      EXPECT_EQ(second.at("vmm_import"), 1);
      EXPECT_EQ(second.at("ipc_open_calls"), 0);
    } else {
      EXPECT_EQ(first.at("ipc_open_mappings"), 1);
      // The second acquire from the same segment opens no handle.
      EXPECT_EQ(second.at("ipc_open_calls"), 1);
      EXPECT_EQ(second.at("ipc_open_mappings"), 1);
    }
    // Each acquire waited on the producer's recorded event, the way it was asked to, opened
    // once for both.
    EXPECT_EQ(second.at("ipc_open_event"), 1);
    EXPECT_EQ(second.at("waits_on_recorded"), 2);
    EXPECT_EQ(second.at(on_stream ? "stream_wait_event" : "event_synchronize"), 2);
    EXPECT_EQ(second.at(on_stream ? "event_synchronize" : "stream_wait_event"), 0);
    // Mappings stay while tensors or the client live, and go after.
    EXPECT_EQ(Counters(output, "released").at(vmm() ? "vmm_now" : "open_now"), 1);
    EXPECT_EQ(closed.at("open_now"), 0);
    EXPECT_EQ(closed.at("vmm_now"), 0);
    if (!vmm()) {
      EXPECT_EQ(closed.at("ipc_unmappings"), 1);
    }
  }
  // Leases released; deleting frees the device buffer.
  tensorshm::StatusOr<ServerStats> stats = client_->Stat();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->leases, 0);
  ASSERT_TRUE(client_->Delete("gpu/x").ok());
  EXPECT_EQ(Pool(kDLCUDA, 2).used_bytes, 0);
  producer.Kill(SIGTERM);
}

// In this process (devices seen as 2,1,0): create on each pooled device by this process's
// ordinal, publish, acquire back as kDLCUDA with the same ordinal; a device without a pool is
// refused naming its UUID.
TEST_P(CudaTest, CreatePublishAcquireInProcessByUuid) {
  // Physical 1 is ordinal 1 here, physical 2 is ordinal 0; physical 0 (ordinal 2) has no pool.
  for (const int ordinal : {0, 1}) {
    tensorshm::StatusOr<WritableTensor> w =
        client_->Create({{kDLInt, 32, 1}, {10, 10}, {}, {kDLCUDA, ordinal}});
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->dl_tensor().device.device_type, kDLCUDA);
    EXPECT_EQ(w->dl_tensor().device.device_id, ordinal);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(w->dl_tensor().data) % 256, 0u);
    const std::string name = absl::StrCat("gpu/in-process-", ordinal);
    ASSERT_TRUE(client_->Publish(*w, name).ok());
    tensorshm::StatusOr<DLManagedTensorVersioned*> t =
        client_->Acquire(name, tensorshm::Duration::zero(), ReadySync::None());
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->dl_tensor.device.device_type, kDLCUDA);
    EXPECT_EQ((*t)->dl_tensor.device.device_id, ordinal);
    EXPECT_TRUE(WaitReady(*t, ReadySync::Host()).ok());
    (*t)->deleter(*t);
  }
  EXPECT_EQ(Pool(kDLCUDA, 1).used_bytes, 512);
  EXPECT_EQ(Pool(kDLCUDA, 2).used_bytes, 512);
  tensorshm::StatusOr<WritableTensor> none =
      client_->Create({{kDLInt, 32, 1}, {4}, {}, {kDLCUDA, 2}});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), tensorshm::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(none.status().message(), "device_uuid = GPU-")) << none.status();
  EXPECT_TRUE(absl::StrContains(none.status().message(), "--cuda-pool")) << none.status();
  tensorshm::StatusOr<WritableTensor> bad =
      client_->Create({{kDLInt, 32, 1}, {4}, {}, {kDLCUDA, 7}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "cuda:7")) << bad.status();
  // Pool exhaustion names requested and free bytes.
  tensorshm::StatusOr<WritableTensor> huge =
      client_->Create({{kDLUInt, 8, 1}, {32 << 20}, {}, {kDLCUDA, 0}});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "33554432 bytes")) << huge.status();
}

// A consumer process's mapping of a published tensor is read-only: a driver write through it is
// refused, a direct store kills the process with SIGSEGV (VMM pools); the bytes stay the
// producer's. Legacy IPC mappings are writable by every holder, as CUDA opens them.
TEST_P(CudaTest, ConsumersCannotWriteAPublishedTensor) {
  ChildProcess producer = Peer({"cuda-produce", "gpu/w", "--device", "0", "--dtype", "uint8",
                                "--shape", "4096", "--seed", "3"},
                               "2,1,0", "producer.log");
  ASSERT_TRUE(producer.WaitForOutput("published", absl::Seconds(30))) << producer.Output();
  for (const std::string how : {"memset", "store"}) {
    SCOPED_TRACE(how);
    // Under AddressSanitizer the fault is left to the kernel (ASan would report it and abort).
    ChildProcess writer = Peer({"cuda-write", "gpu/w", "--how", how}, "1,2", how + ".log",
                               {"ASAN_OPTIONS=handle_segv=0"});
    absl::StatusOr<int> status = writer.Wait(absl::Seconds(60));
    ASSERT_TRUE(status.ok());
    if (!vmm()) {
      EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << writer.Output();
      EXPECT_TRUE(absl::StrContains(writer.Output(), "wrote")) << writer.Output();
      break;  // the bytes are changed now: nothing more to check
    }
    if (how == "memset") {
      EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << writer.Output();
      EXPECT_TRUE(absl::StrContains(writer.Output(), "refused CUDA_ERROR_INVALID_VALUE"))
          << writer.Output();
    } else {
      EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGSEGV) << writer.Output();
    }
    ChildProcess consumer = Peer({"cuda-consume", "gpu/w"}, "1,2", how + "-after.log");
    const std::string output = Run(consumer);
    EXPECT_EQ(Line(output, "checksum"), Line(producer.Output(), "checksum")) << output;
  }
  producer.Kill(SIGTERM);
}

// A producer's buffer is writable until its publish, and read-only in its own process after.
TEST_P(CudaTest, TheProducersMappingIsSealedAtPublish) {
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  ASSERT_TRUE(driver.ok()) << driver.status();
  tensorshm::StatusOr<WritableTensor> w =
      client_->Create({{kDLUInt, 8, 1}, {1000}, {}, {kDLCUDA, 0}});
  ASSERT_TRUE(w.ok()) << w.status();
  const CUdeviceptr data = reinterpret_cast<CUdeviceptr>(w->dl_tensor().data);
  CUdevice device;
  CUcontext context;
  ASSERT_EQ((*driver)->cuDeviceGet(&device, 0), CUDA_SUCCESS);
  ASSERT_EQ((*driver)->cuDevicePrimaryCtxRetain(&context, device), CUDA_SUCCESS);
  {
    ScopedContext scope(*driver, context);
    EXPECT_EQ((*driver)->cuMemsetD8_v2(data, 7, 1000), CUDA_SUCCESS);
    ASSERT_TRUE(client_->Publish(*w, "gpu/sealed").ok());
    EXPECT_EQ((*driver)->cuMemsetD8_v2(data, 8, 1000),
              vmm() ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS);
    std::vector<unsigned char> bytes(1000);
    EXPECT_EQ((*driver)->cuMemcpyDtoH_v2(bytes.data(), data, bytes.size()), CUDA_SUCCESS);
    EXPECT_EQ(bytes, std::vector<unsigned char>(1000, vmm() ? 7 : 8));
  }
  (*driver)->cuDevicePrimaryCtxRelease_v2(device);
}

INSTANTIATE_TEST_SUITE_P(Kinds, CudaTest, ::testing::Values("vmm", "ipc"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// The pool kind: auto takes VMM where the driver has it, legacy IPC where it does not (logged);
// vmm on a driver without it stops the daemon at start naming the flag; an unknown kind is refused.
TEST(CudaStartTest, PoolKindFollowsTheDriver) {
  const std::string dir = ::testing::TempDir();
  struct Case {
    std::vector<std::string> env;
    std::string kind;
    int exit_code;
    std::string expected;
  };
  std::vector<std::string> no_vmm = DriverEnv("0,1");
  no_vmm.push_back("TSM_FAKE_CUDA_NO_VMM=1");
  const std::vector<Case> cases = {
      {DriverEnv("0,1"), "auto", -1, "vmm pool of 4 MiB"},
      {no_vmm, "auto", -1, "legacy IPC pool: the driver reports no VMM"},
      {no_vmm, "vmm", 1, "--cuda-pool-kind vmm, but the driver"},
      {DriverEnv("0,1"), "cuda", 2, "--cuda-pool-kind = \"cuda\": expected auto, vmm or ipc"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].expected);
    const std::string socket = absl::StrCat(dir, "/kind-", getpid(), "-", i, ".sock");
    absl::StatusOr<ChildProcess> daemon = ChildProcess::Start(
        {TensorShmdPath(), "--socket", socket, "--host-pool", "4Mi", "--cuda-pool", "cuda:0=4Mi",
         "--cuda-pool-kind", cases[i].kind, "--log-level", "info"},
        absl::StrCat(dir, "/kind-", getpid(), "-", i, ".log"), cases[i].env);
    ASSERT_TRUE(daemon.ok());
    if (cases[i].exit_code < 0) {
      EXPECT_TRUE(daemon->WaitForOutput(cases[i].expected, absl::Seconds(20))) << daemon->Output();
      EXPECT_TRUE(daemon->WaitForOutput("serving on", absl::Seconds(20))) << daemon->Output();
      daemon->Kill(SIGTERM);  // a clean stop: its shared memory goes with it
      absl::StatusOr<int> status = daemon->Wait(absl::Seconds(30));
      EXPECT_TRUE(status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0)
          << daemon->Output();
      continue;
    }
    absl::StatusOr<int> status = daemon->Wait(absl::Seconds(20));
    ASSERT_TRUE(status.ok());
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == cases[i].exit_code)
        << daemon->Output();
    EXPECT_TRUE(absl::StrContains(daemon->Output(), cases[i].expected)) << daemon->Output();
  }
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
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon->socket(), "nodriver"});
  ASSERT_TRUE(client.ok());
  tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLFloat, 32, 1}, {16}});
  ASSERT_TRUE(w.ok());
  static_cast<float*>(w->data())[3] = 2.5f;
  ASSERT_TRUE((*client)->Publish(*w, "host").ok());
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire("host");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(static_cast<const float*>((*t)->dl_tensor.data)[3], 2.5f);
  (*t)->deleter(*t);
  tensorshm::StatusOr<WritableTensor> gpu =
      (*client)->Create({{kDLFloat, 32, 1}, {16}, {}, {kDLCUDA, 0}});
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(gpu.status().message(), "no CUDA driver")) << gpu.status();
}

}  // namespace
}  // namespace tensorshm::testing
