// CUDA tensors between processes, against the real driver with TENSORSHM_REAL_GPU=1 (a GPU
// machine, or `make gpu-bundle`'s tarball there), else against the emulated one (CI): a real
// daemon with a CUDA pool, producers and consumers that are this program run again in a role.
//
//   real_gpu_tests                      the tests (gtest flags apply)
//   real_gpu_tests --role ROLE ...      a producer or consumer process the tests start
//
// Environment: TENSORSHM_REAL_GPU=1 uses libcuda.so.1 (device 0); TENSORSHM_REAL_GPU_BYTES sets
// the tensor size (default 1 GiB on a GPU, 64 MiB emulated); TENSORSHMD names the daemon (default:
// the build's, or tensorshmd next to this program in a bundle).
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_driver.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

bool RealGpu() {
  const char* real = std::getenv("TENSORSHM_REAL_GPU");
  return real != nullptr && std::string(real) == "1";
}

uint64_t TensorBytes() {
  uint64_t bytes = RealGpu() ? (uint64_t{1} << 30) : (uint64_t{64} << 20);
  if (const char* text = std::getenv("TENSORSHM_REAL_GPU_BYTES")) {
    if (!absl::SimpleAtoi(text, &bytes) || bytes == 0 || bytes % 4096 != 0) {
      std::cerr << "TENSORSHM_REAL_GPU_BYTES = " << text << ": a positive multiple of 4096\n";
      std::exit(2);
    }
  }
  return bytes;
}

// The byte at `i` of the tensor a producer with `seed` fills: its last memset pass's value.
unsigned char Pattern(int seed) { return static_cast<unsigned char>(0x30 + seed); }

template <typename AnyStatus>  // the client's tensorshm::Status, or the CUDA helpers' absl one
int Fail(const AnyStatus& status) {
  std::cout << "error " << status << std::endl;
  return 1;
}

// Device 0's primary context, current on this thread.
absl::StatusOr<const CudaDriver*> EnterDevice() {
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  CUdevice device;
  CUcontext context;
  if (absl::Status s = TSM_CU(*driver, 0, cuDeviceGet, &device, 0); !s.ok()) return s;
  if (absl::Status s = TSM_CU(*driver, 0, cuDevicePrimaryCtxRetain, &context, device); !s.ok()) {
    return s;
  }
  if (absl::Status s = TSM_CU(*driver, 0, cuCtxPushCurrent_v2, context); !s.ok()) return s;
  return driver;
}

// --role produce SOCKET NAME SEED [--exit]: creates the tensor on device 0, fills it with eight
// asynchronous memset passes on a stream of its own (the last writes Pattern(SEED)), publishes
// with that stream as the ready stream while the passes may still run, says whether they were
// still running, then waits for stdin to close (or exits at once with --exit).
int Produce(const std::string& socket, const std::string& name, int seed, bool exit_at_once) {
  absl::StatusOr<const CudaDriver*> driver = EnterDevice();
  if (!driver.ok()) return Fail(driver.status());
  const CudaDriver* cu = *driver;
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{socket, "real-gpu-producer"});
  if (!client.ok()) return Fail(client.status());
  const uint64_t bytes = TensorBytes();
  tensorshm::StatusOr<WritableTensor> w =
      (*client)->Create({{kDLUInt, 8, 1}, {static_cast<int64_t>(bytes)}, {}, {kDLCUDA, 0}});
  if (!w.ok()) return Fail(w.status());
  CUstream stream;
  if (absl::Status s = TSM_CU(cu, 0, cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING); !s.ok()) {
    return Fail(s);
  }
  const auto data = reinterpret_cast<CUdeviceptr>(w->data());
  for (int pass = 7; pass >= 0; --pass) {
    const unsigned char value = pass == 0 ? Pattern(seed) : static_cast<unsigned char>(pass);
    if (absl::Status s = TSM_CU(cu, 0, cuMemsetD8Async, data, value, bytes, stream); !s.ok()) {
      return Fail(s);
    }
  }
  if (tensorshm::Status s =
          (*client)->Publish(*w, name, /*replace=*/true, reinterpret_cast<CudaStream>(stream));
      !s.ok()) {
    return Fail(s);
  }
  const CUresult query = cu->cuStreamQuery(stream);
  std::cout << "published in_flight=" << (query == CUDA_ERROR_NOT_READY ? 1 : 0) << std::endl;
  if (!exit_at_once) {
    std::string line;
    while (std::getline(std::cin, line)) {
    }
  }
  cu->cuStreamDestroy_v2(stream);  // its work goes on to the end
  return 0;
}

// --role consume SOCKET NAME SEED: acquires (the host waits for the ready event), checks every
// byte against Pattern(SEED), tries a write through the acquired pointer (cuMemsetD8) and reads
// again after it; prints "bytes ok", "write refused <error>" or "write accepted", "context ok".
int Consume(const std::string& socket, const std::string& name, int seed) {
  absl::StatusOr<const CudaDriver*> driver = EnterDevice();
  if (!driver.ok()) return Fail(driver.status());
  const CudaDriver* cu = *driver;
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{socket, "real-gpu-consumer"});
  if (!client.ok()) return Fail(client.status());
  tensorshm::StatusOr<DLManagedTensorVersioned*> t =
      (*client)->Acquire(name, std::chrono::seconds(60), ReadySync::Host());
  if (!t.ok()) return Fail(t.status());
  const DLTensor& dl = (*t)->dl_tensor;
  const uint64_t bytes = static_cast<uint64_t>(dl.shape[0]);
  const auto data = reinterpret_cast<CUdeviceptr>(dl.data) + dl.byte_offset;
  std::vector<unsigned char> host(bytes);
  if (absl::Status s = TSM_CU(cu, 0, cuMemcpyDtoH_v2, host.data(), data, bytes); !s.ok()) {
    return Fail(s);
  }
  uint64_t wrong = 0;
  for (unsigned char b : host) wrong += b != Pattern(seed);
  std::cout << (wrong == 0 ? "bytes ok" : absl::StrCat("bytes wrong ", wrong)) << std::endl;
  const CUresult write = cu->cuMemsetD8_v2(data, 0xEE, 4096);
  const char* error = "?";
  cu->cuGetErrorName(write, &error);
  std::cout << (write == CUDA_SUCCESS ? "write accepted" : absl::StrCat("write refused ", error))
            << std::endl;
  unsigned char first[16];
  if (absl::Status s = TSM_CU(cu, 0, cuMemcpyDtoH_v2, first, data, sizeof(first)); s.ok()) {
    std::cout << (first[0] == Pattern(seed) ? "context ok" : "context ok, bytes changed")
              << std::endl;
  } else {
    std::cout << "context broken " << s << std::endl;
  }
  (*t)->deleter(*t);
  return 0;
}

class RealGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (RealGpu()) {
      unsetenv("TENSORSHM_LIBCUDA");
    } else {
      setenv("TENSORSHM_LIBCUDA", FakeCudaPath().c_str(), 1);
      setenv("TSM_FAKE_CUDA_DEVICES", "1", 1);
      // Unfinished at publish: the consumers' first queries of the ready event say so.
      setenv("TSM_FAKE_CUDA_BUSY_QUERIES", "3", 1);
    }
    absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
    if (!driver.ok()) GTEST_SKIP() << "no CUDA driver: " << driver.status();
    absl::StatusOr<int> count = (*driver)->DeviceCount();
    if (!count.ok() || *count == 0) GTEST_SKIP() << "the CUDA driver sees no device";
    const uint64_t pool = 3 * TensorBytes() + (64 << 20);
    absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
        std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()).substr(0, 20),
        {"--host-pool", "16Mi", "--cuda-pool", absl::StrCat("cuda:0=", pool, "B"), "--log-level",
         "info"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "real-gpu-test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();
    if (RealGpu()) return;
    RemoveDeadProcessesFakeCudaPages();  // a producer killed at the end leaves its events' pages
  }

  ChildProcess Role(const std::vector<std::string>& args, const std::string& log) {
    std::vector<std::string> argv = {self_, "--role"};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<ChildProcess> child = ChildProcess::Start(argv, daemon_->dir() + "/" + log);
    EXPECT_TRUE(child.ok()) << child.status();
    return *std::move(child);
  }

  // A consumer's output, once it exited 0.
  static std::string Finish(ChildProcess& child) {
    absl::StatusOr<int> status = child.Wait(absl::Seconds(120));
    EXPECT_TRUE(status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << child.Output();
    return child.Output();
  }

  static void ExpectConsumed(const std::string& output) {
    EXPECT_TRUE(absl::StrContains(output, "bytes ok")) << output;
    EXPECT_TRUE(absl::StrContains(output, "write refused")) << output;
    EXPECT_TRUE(absl::StrContains(output, "context ok\n")) << output;
  }

  int64_t Leases() {
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
    EXPECT_TRUE(stats.ok());
    return stats.ok() ? stats->leases : -1;
  }

 public:
  static std::string self_;

 protected:
  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
};
std::string RealGpuTest::self_;

// A producer publishes while its device work may still run; two consumers at once read every
// byte right (each waits for the ready event), cannot write through their mapping, and keep a
// usable context; the leases are back to 0 after them.
TEST_F(RealGpuTest, TwoConsumersWhileTheProducersWorkIsInFlight) {
  ChildProcess producer = Role({"produce", daemon_->socket(), "gpu/x", "1"}, "producer.log");
  ASSERT_TRUE(producer.WaitForOutput("published", absl::Seconds(120))) << producer.Output();
  std::cout << "producer: " << producer.Output();
  ChildProcess first = Role({"consume", daemon_->socket(), "gpu/x", "1"}, "first.log");
  ChildProcess second = Role({"consume", daemon_->socket(), "gpu/x", "1"}, "second.log");
  ExpectConsumed(Finish(first));
  ExpectConsumed(Finish(second));
  EXPECT_EQ(Leases(), 0);
  producer.Kill(SIGTERM);
  ASSERT_TRUE(client_->Delete("gpu/x").ok());
}

// A producer that exits right after its publish: the tensor stays (the daemon holds its memory)
// and a consumer that comes later reads it right.
TEST_F(RealGpuTest, ProducerExitsBeforeTheAcquire) {
  ChildProcess producer =
      Role({"produce", daemon_->socket(), "gpu/gone", "2", "--exit"}, "producer.log");
  absl::StatusOr<int> status = producer.Wait(absl::Seconds(120));
  ASSERT_TRUE(status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << producer.Output();
  ChildProcess consumer = Role({"consume", daemon_->socket(), "gpu/gone", "2"}, "consumer.log");
  ExpectConsumed(Finish(consumer));
  EXPECT_EQ(Leases(), 0);
  ASSERT_TRUE(client_->Delete("gpu/gone").ok());
}

}  // namespace
}  // namespace tensorshm::testing

int main(int argc, char** argv) {
  tensorshm::testing::RealGpuTest::self_ = std::filesystem::canonical("/proc/self/exe").string();
  if (argc >= 6 && std::string(argv[1]) == "--role") {
    const std::string role = argv[2];
    int seed = 0;
    if (!absl::SimpleAtoi(argv[5], &seed)) return 2;
    if (role == "produce") {
      const bool exit_at_once = argc >= 7 && std::string(argv[6]) == "--exit";
      return tensorshm::testing::Produce(argv[3], argv[4], seed, exit_at_once);
    }
    if (role == "consume") return tensorshm::testing::Consume(argv[3], argv[4], seed);
    return 2;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
