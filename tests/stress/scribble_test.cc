// A process of the daemon's uid writes random bytes over the daemon's control segment
// (/dev/shm/<prefix>.ctl, header included) while client processes publish, replace, acquire
// (fast path and RPC) and read back. The daemon must keep serving, no client may crash, and
// every error a client sees must be one a damaged catalog explains (DATA_LOSS for a tensor whose
// record was overwritten, NOT_FOUND for a name that is gone).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/shm/catalog_layout.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int kWorkers = 4;
constexpr int kWorkerSeconds = 6;
constexpr int kScribbleSeconds = 3;
constexpr uint64_t kSeed = 1107;

std::string ScribblePeerPath() { return TSM_SCRIBBLE_PEER_PATH; }

// "code <NAME> <count>" lines of a worker's output, added into `codes`.
void AddCodes(const std::string& output, std::map<std::string, int64_t>* codes) {
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    const std::vector<std::string> words = absl::StrSplit(line, ' ');
    int64_t count = 0;
    if (words.size() == 3 && words[0] == "code" && absl::SimpleAtoi(words[2], &count)) {
      (*codes)[words[1]] += count;
    }
  }
}

// Publishes `elements` uint32 values `value` as `name`.
tensorshm::Status PublishFilled(Client& client, const std::string& name, int64_t elements,
                                uint32_t value) {
  tensorshm::StatusOr<WritableTensor> w = client.Create({{kDLUInt, 32, 1}, {elements}});
  if (!w.ok()) return w.status();
  std::fill_n(static_cast<uint32_t*>(w->data()), elements, value);
  return client.Publish(*w, name);
}

// OK if `t` is `elements` uint32 values `value`.
::testing::AssertionResult Holds(const DLManagedTensorVersioned* t, int64_t elements,
                                 uint32_t value) {
  const DLTensor& dl = t->dl_tensor;
  if (dl.dtype.code != kDLUInt || dl.dtype.bits != 32 || dl.ndim != 1 || dl.shape[0] != elements) {
    return ::testing::AssertionFailure() << "wrong descriptor: ndim " << dl.ndim;
  }
  const auto* data =
      reinterpret_cast<const uint32_t*>(static_cast<const char*>(dl.data) + dl.byte_offset);
  for (int64_t i = 0; i < elements; ++i) {
    if (data[i] != value) {
      return ::testing::AssertionFailure()
             << "element " << i << " = " << data[i] << ", not " << value;
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(ScribbleTest, DaemonKeepsServingWhileAnotherProcessScribblesItsControlSegment) {
  absl::StatusOr<TestDaemon> started =
      TestDaemon::Start("scribble", {"--segments", "shm", "--host-pool", "256Mi", "--segment-size",
                                     "32Mi", "--max-tensors", "256"});
  ASSERT_TRUE(started.ok()) << started.status();
  TestDaemon& daemon = *started;
  const std::string control = absl::StrCat("/dev/shm/", daemon.shm_prefix(), ".ctl");
  ASSERT_TRUE(std::filesystem::exists(control)) << control;

  std::vector<ChildProcess> workers;
  for (int i = 0; i < kWorkers; ++i) {
    absl::StatusOr<ChildProcess> worker =
        ChildProcess::Start({ScribblePeerPath(), "work", daemon.socket(), "--worker",
                             std::to_string(i), "--workers", std::to_string(kWorkers), "--seconds",
                             std::to_string(kWorkerSeconds), "--seed", std::to_string(kSeed + i)},
                            absl::StrCat(daemon.dir(), "/worker", i, ".log"));
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(*std::move(worker));
  }
  // The workers are under way (each has published a name) before the scribbling starts, and go
  // on after it stops.
  {
    tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> watcher =
        tensorshm::Client::Connect({daemon.socket(), "scribble-watcher"});
    ASSERT_TRUE(watcher.ok()) << watcher.status();
    std::set<std::string> publishing;
    for (int i = 0; i < 3000 && publishing.size() < static_cast<size_t>(kWorkers); ++i) {
      tensorshm::StatusOr<std::vector<tensorshm::TensorInfo>> listed = (*watcher)->List("w");
      ASSERT_TRUE(listed.ok()) << listed.status();
      for (const tensorshm::TensorInfo& info : *listed)
        publishing.insert(info.name.substr(0, info.name.find('/')));
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_EQ(publishing.size(), static_cast<size_t>(kWorkers)) << "workers publishing";
  }
  absl::StatusOr<ChildProcess> scribbler =
      ChildProcess::Start({ScribblePeerPath(), "scribble", control, "--seconds",
                           std::to_string(kScribbleSeconds), "--seed", std::to_string(kSeed)},
                          daemon.dir() + "/scribbler.log");
  ASSERT_TRUE(scribbler.ok()) << scribbler.status();
  absl::StatusOr<int> scribbled = scribbler->Wait(absl::Seconds(60));
  ASSERT_TRUE(scribbled.ok()) << scribbled.status();
  EXPECT_TRUE(WIFEXITED(*scribbled) && WEXITSTATUS(*scribbled) == 0) << scribbler->Output();
  std::cout << "seed " << kSeed << ": " << Line(scribbler->Output(), "scribbled") << " writes over "
            << control << std::endl;

  std::map<std::string, int64_t> codes;
  for (int i = 0; i < kWorkers; ++i) {
    absl::StatusOr<int> status = workers[i].Wait(absl::Seconds(60));
    ASSERT_TRUE(status.ok()) << "worker " << i << ": " << status.status();
    const std::string output = workers[i].Output();
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0)
        << "worker " << i << " did not exit normally (wait status " << *status << "): " << output;
    EXPECT_TRUE(absl::StrContains(output, "\ndone\n")) << "worker " << i << ": " << output;
    AddCodes(output, &codes);
    std::cout << "worker " << i << ": acquired " << Line(output, "acquired") << std::endl;
  }
  std::string summary;
  for (const auto& [code, count] : codes) absl::StrAppend(&summary, " ", code, " ", count);
  std::cout << "client outcomes by code:" << summary << std::endl;
  const std::set<std::string> expected = {"OK", "NOT_FOUND", "DATA_LOSS"};
  for (const auto& [code, count] : codes) {
    EXPECT_TRUE(expected.count(code) > 0) << count << " calls answered " << code;
  }
  EXPECT_GT(codes["OK"], 0);

  // The daemon is alive, noticed the damage, and never failed a check.
  ASSERT_TRUE(absl::IsDeadlineExceeded(daemon.process().Wait(absl::ZeroDuration()).status()))
      << "tensorshmd exited: " << daemon.process().Output();
  const std::string log = daemon.process().Output();
  EXPECT_TRUE(absl::StrContains(log, "was overwritten by another process")) << log;
  EXPECT_FALSE(absl::StrContains(log, "check failed")) << log;
  int damaged = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    damaged += absl::StrContains(line, "was overwritten by another process") ? 1 : 0;
  }
  std::cout << "daemon log: " << damaged << " damaged tensors reported" << std::endl;

  // It keeps serving: Stat, and new names published and acquired (fast path, then RPC).
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon.socket(), "scribble_test"});
  ASSERT_TRUE(client.ok()) << client.status();
  tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
  ASSERT_TRUE(stats.ok()) << stats.status();
  std::cout << "after: tensors " << stats->tensors << ", leases " << stats->leases << ", sessions "
            << stats->sessions << std::endl;
  for (uint32_t i = 0; i < 8; ++i) {
    const std::string name = absl::StrCat("after/", i);
    const int64_t elements = 1000 + i;
    ASSERT_TRUE(PublishFilled(**client, name, elements, 0xa000 + i).ok()) << name;
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire(name);
    ASSERT_TRUE(t.ok()) << name << ": " << t.status();
    EXPECT_TRUE(Holds(*t, elements, 0xa000 + i)) << name;
    (*t)->deleter(*t);
    tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLUInt, 32, 1}, {elements}});
    ASSERT_TRUE(w.ok()) << w.status();
    std::fill_n(static_cast<uint32_t*>(w->data()), elements, 0xb000 + i);
    tensorshm::StatusOr<DLManagedTensorVersioned*> acquired =
        (*client)->PublishAndAcquire(*w, name, /*replace=*/true);
    ASSERT_TRUE(acquired.ok()) << name << ": " << acquired.status();
    EXPECT_TRUE(Holds(*acquired, elements, 0xb000 + i)) << name;
    (*acquired)->deleter(*acquired);
  }
  // Every name, damaged or not, can be deleted; then nothing is left but what leases hold.
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = (*client)->List();
  ASSERT_TRUE(listed.ok()) << listed.status();
  for (const TensorInfo& info : *listed) {
    EXPECT_TRUE((*client)->Delete(info.name).ok()) << info.name;
  }
  ASSERT_TRUE((*client)->Flush().ok());
  // This client's stock of unpublished buffers goes with its session; tensors lease pages held go
  // at the housekeeping round after their sessions end.
  client->reset();
  client = Client::Connect(ClientOptions{daemon.socket(), "scribble_test_stat"});
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Time limit = absl::Now() + absl::Seconds(10);
  do {
    stats = (*client)->Stat();
    ASSERT_TRUE(stats.ok()) << stats.status();
    if (stats->tensors == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  } while (absl::Now() < limit);
  EXPECT_EQ(stats->leases, 0);
  EXPECT_EQ(stats->tensors, 0);
  EXPECT_EQ(stats->pools.at(0).used_bytes, 0);

  std::cout << "deleted " << listed->size() << " names; tensors " << stats->tensors
            << ", pool used " << stats->pools.at(0).used_bytes << std::endl;
}

// The control segment as another process of the daemon's uid maps it: read-write.
class ControlMapping {
 public:
  explicit ControlMapping(const std::string& path) {
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) return;
    size_ = static_cast<uint64_t>(st.st_size);
    void* address = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (address != MAP_FAILED) base_ = static_cast<char*>(address);
  }
  ~ControlMapping() {
    if (base_ != nullptr) munmap(base_, size_);
  }
  bool ok() const { return base_ != nullptr && size_ > RecordsOffset(); }
  // The record holding `tensor_id`, or nullptr.
  TensorRecord* Find(uint64_t tensor_id) const {
    auto* records = reinterpret_cast<TensorRecord*>(base_ + RecordsOffset());
    const uint64_t count = (size_ - RecordsOffset()) / sizeof(TensorRecord);
    for (uint64_t i = 0; i < count; ++i) {
      if (records[i].tensor_id == tensor_id) return &records[i];
    }
    return nullptr;
  }
  SegmentRecord& segment(uint32_t index) const {
    return reinterpret_cast<SegmentRecord*>(base_ + kControlHeaderBytes)[index];
  }

 private:
  char* base_ = nullptr;
  uint64_t size_ = 0;
};

// One field of a published tensor's record overwritten at a time, each with a value the client's
// fast path must refuse (it would read outside a mapping, or describe another tensor): every
// acquire of it is DATA_LOSS from the daemon, never a crash, never a tensor built from the
// record. A damaged segment record only sends readers to the daemon, which serves them.
TEST(ScribbleTest, EachOverwrittenRecordFieldIsDataLossNeverACrash) {
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("scribble-fields", {"--segments", "shm", "--max-tensors", "64"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ControlMapping control(absl::StrCat("/dev/shm/", daemon->shm_prefix(), ".ctl"));
  ASSERT_TRUE(control.ok());
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon->socket(), "scribble_fields"});
  ASSERT_TRUE(client.ok()) << client.status();

  const std::vector<std::pair<std::string, std::function<void(TensorRecord&)>>> overwrites = {
      {"ndim 1000", [](TensorRecord& r) { r.ndim = 1000; }},
      {"ndim -1", [](TensorRecord& r) { r.ndim = -1; }},
      {"shape[0] 2^40", [](TensorRecord& r) { r.shape[0] = int64_t{1} << 40; }},
      {"strides[0] -2^40", [](TensorRecord& r) { r.strides[0] = -(int64_t{1} << 40); }},
      {"nbytes 2^50", [](TensorRecord& r) { r.nbytes = int64_t{1} << 50; }},
      {"length 2^50", [](TensorRecord& r) { r.length = uint64_t{1} << 50; }},
      {"offset 2^50", [](TensorRecord& r) { r.offset = uint64_t{1} << 50; }},
      {"offset wraps", [](TensorRecord& r) { r.offset = ~uint64_t{0} - 100; }},
      {"segment_id 65535", [](TensorRecord& r) { r.segment_id = 65535; }},
      {"segment_id 0", [](TensorRecord& r) { r.segment_id = 0; }},
      {"name_length 100000", [](TensorRecord& r) { r.name_length = 100000; }},
      {"dtype code 200", [](TensorRecord& r) { r.dtype_code = 200; }},
      {"dtype bits 3 lanes 2",
       [](TensorRecord& r) {
         r.dtype_bits = 3;
         r.dtype_lanes = 2;
       }},
      {"dlpack_flags 7", [](TensorRecord& r) { r.dlpack_flags = 7; }},
      {"device cuda", [](TensorRecord& r) { r.device_type = kDLCUDA; }},
      {"state 77", [](TensorRecord& r) { r.state.store(77); }},
      {"tensor_id", [](TensorRecord& r) { r.tensor_id += 1000; }},
  };
  for (size_t i = 0; i < overwrites.size(); ++i) {
    const auto& [what, overwrite] = overwrites[i];
    const std::string name = absl::StrCat("field/", i);
    tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLUInt, 32, 1}, {1024}});
    ASSERT_TRUE(w.ok()) << w.status();
    std::fill_n(static_cast<uint32_t*>(w->data()), 1024, 7u);
    const uint64_t id = w->tensor_id();
    ASSERT_TRUE((*client)->Publish(*w, name).ok()) << name;
    TensorRecord* record = control.Find(id);
    ASSERT_NE(record, nullptr) << what;
    overwrite(*record);
    for (int round = 0; round < 3; ++round) {  // before and after the daemon's sweep finds it
      tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire(name);
      ASSERT_FALSE(t.ok()) << what << ": acquired from an overwritten record";
      EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss) << what << ": " << t.status();
      if (round == 0) std::cout << what << ": " << t.status().message() << std::endl;
      absl::SleepFor(absl::Milliseconds(15));
    }
    ASSERT_TRUE((*client)->Delete(name).ok()) << what;
  }

  // A segment record that no longer fits: readers go to the daemon, which serves the tensor;
  // the daemon writes the record back.
  ASSERT_TRUE(PublishFilled(**client, "intact", 1024, 9u).ok());
  const uint64_t size = control.segment(0).size;
  control.segment(0).size = 1;
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire("intact");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(Holds(*t, 1024, 9u));
  (*t)->deleter(*t);
  const absl::Time limit = absl::Now() + absl::Seconds(10);
  while (control.segment(0).size != size && absl::Now() < limit) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(control.segment(0).size, size) << "segment record not written back";
  ASSERT_TRUE(absl::IsDeadlineExceeded(daemon->process().Wait(absl::ZeroDuration()).status()))
      << daemon->process().Output();
}

}  // namespace
}  // namespace tensorshm::testing
