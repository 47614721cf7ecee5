// A long-running CUDA producer keeps a bounded number of ready events: each publish records an
// interprocess event, which is taken back (to be recorded again, or destroyed past
// kMaxFreeEvents) once the daemon no longer holds the tensor it was recorded for, and not before
// (acquirers open its handle as long as the tensor is held). Against the
// emulated driver (tests/support/fake_cuda), with a real daemon; this process is the producer.
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/fake_cuda/fake_cuda.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int kPublishes = 600;
// The client looks for events to destroy once it holds 64 (kMinReadyEventSweep), and again
// once it holds twice what the last look left.
constexpr int64_t kBound = 2 * 64;

std::vector<std::string> DriverEnv() {
  return {"TENSORSHM_LIBCUDA=" + FakeCudaPath(), "TSM_FAKE_CUDA_DEVICES=2",
          "TSM_FAKE_CUDA_VISIBLE=0,1"};
}

class CudaReadyEventTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
        "cuda_events", {"--host-pool", "16Mi", "--cuda-pool", "cuda:1=16Mi"}, DriverEnv());
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    setenv("TENSORSHM_LIBCUDA", FakeCudaPath().c_str(), 1);
    setenv("TSM_FAKE_CUDA_DEVICES", "2", 1);
    setenv("TSM_FAKE_CUDA_VISIBLE", "0,1", 1);
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "cuda_event_test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();
    // A test that failed half-way may leave its emulated events' pages behind.
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      const std::string file = entry.path().filename().string();
      if (absl::StartsWith(file, absl::StrCat("tsmfakecu.", getpid(), "."))) {
        std::filesystem::remove(entry.path());
      }
    }
  }

  tensorshm::Status Publish(const std::string& name) {
    tensorshm::StatusOr<WritableTensor> w =
        client_->Create({{kDLFloat, 32, 1}, {64}, {}, {kDLCUDA, 1}});
    if (!w.ok()) return w.status();
    return client_->Publish(*w, name, /*replace=*/true);
  }

  // Runs a consumer process that acquires `name` (opening the producer's event handle and waiting
  // on it); its exit status and output.
  std::pair<bool, std::string> Consume(const std::string& name) {
    absl::StatusOr<ChildProcess> child = ChildProcess::Start(
        {PeerPath(), "cuda-consume", daemon_->socket(), name},
        daemon_->dir() + "/consume-" + name.substr(name.find('/') + 1) + ".log", DriverEnv());
    if (!child.ok()) return {false, std::string(child.status().message())};
    absl::StatusOr<int> status = child->Wait(absl::Seconds(60));
    return {status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0, child->Output()};
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
};

TEST_F(CudaReadyEventTest, PublishReplaceCyclesKeepLiveEventsBounded) {
  // A tensor leased all along: its event must outlive every sweep.
  ASSERT_TRUE(Publish("evt/held").ok());
  tensorshm::StatusOr<DLManagedTensorVersioned*> held =
      client_->Acquire("evt/held", tensorshm::Duration::zero(), ReadySync::None());
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_TRUE(client_->Delete("evt/held").ok());  // unbound, kept by the lease

  // The driver is loaded now; its test interface comes from the same library.
  void* driver = dlopen(FakeCudaPath().c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(driver, nullptr) << dlerror();
  auto live_events = reinterpret_cast<decltype(&tsm_fake_cuda_live_events)>(
      dlsym(driver, "tsm_fake_cuda_live_events"));
  ASSERT_NE(live_events, nullptr);

  int64_t most = 0;
  for (int i = 0; i < kPublishes; ++i) {
    const tensorshm::Status published = Publish("evt/x");
    ASSERT_TRUE(published.ok()) << "publish " << i << ": " << published;
    most = std::max(most, live_events());
  }
  auto counters =
      reinterpret_cast<decltype(&tsm_fake_cuda_counters)>(dlsym(driver, "tsm_fake_cuda_counters"));
  ASSERT_NE(counters, nullptr);
  const int64_t created = counters()->event_create;
  const int64_t recorded = counters()->event_record;
  std::cout << "ready events: " << created << " created and " << recorded << " records over "
            << kPublishes + 1 << " publishes, at most " << most << " alive at once, "
            << live_events() << " alive at the end\n";
  EXPECT_LE(most, kBound);
  // Every publish recorded one; events of freed tensors were recorded again, not made anew.
  EXPECT_EQ(recorded, kPublishes + 1);
  EXPECT_LE(created, kBound);

  // The held tensor's event survived: this process waits on it, and another process opens it.
  EXPECT_TRUE(WaitReady(*held, ReadySync::Host()).ok());
  // The latest tensor's event is there for a consumer in another process.
  const auto [ok, output] = Consume("evt/x");
  EXPECT_TRUE(ok) << output;
  (*held)->deleter(*held);
  dlclose(driver);
}

}  // namespace
}  // namespace tensorshm::testing
