// One daemon per shm prefix (issue 21): a second tensorshmd given a live daemon's --shm-prefix
// is refused, naming the holder, and the first serves on untouched; a killed daemon's prefix is
// recovered; `tensorshmctl leftovers` finds and removes a killed daemon's objects and never a
// live one's. Real daemons, real shared memory, real tensorshmctl processes.
#include "common/base/prefix_lock.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tensorshm/client.h"
#include "tests/support/ctl_run.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

#define ASSERT_OK(x) ASSERT_TRUE((x).ok()) << (x).status()

// The /dev/shm entries of `prefix` ("<prefix>.ctl", "<prefix>.cpu.1", ...), sorted.
std::vector<std::string> ShmObjects(const std::string& prefix) {
  std::vector<std::string> names;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (dirent* entry = readdir(dir)) {
    if (absl::StartsWith(entry->d_name, prefix + ".")) names.push_back(entry->d_name);
  }
  closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

// Creates a uint8 tensor of `bytes` filled with `seed`-derived bytes and publishes it.
void Put(Client& client, const std::string& name, int64_t bytes, uint8_t seed) {
  tensorshm::StatusOr<WritableTensor> w = client.Create({{kDLUInt, 8, 1}, {bytes}});
  ASSERT_OK(w);
  auto* data = static_cast<uint8_t*>(w->data());
  for (int64_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(seed + i * 7);
  ASSERT_TRUE(client.Publish(*w, name).ok()) << name;
}

// Acquires `name` and checks every byte Put wrote.
void ExpectTensor(Client& client, const std::string& name, int64_t bytes, uint8_t seed) {
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = client.Acquire(name);
  ASSERT_OK(t);
  ASSERT_EQ((*t)->dl_tensor.shape[0], bytes) << name;
  const auto* data = static_cast<const uint8_t*>((*t)->dl_tensor.data);
  int64_t wrong = 0;
  for (int64_t i = 0; i < bytes; ++i) wrong += data[i] != static_cast<uint8_t>(seed + i * 7);
  EXPECT_EQ(wrong, 0) << name;
  (*t)->deleter(*t);
}

struct Sized {
  std::string name;
  int64_t bytes;
  uint8_t seed;
};

// Sizes that land in the first segment, and one (40 MiB, over --segment-size 16Mi) that gets a
// segment of its own.
const std::vector<Sized> kTensors = {
    {"a", 64, 1}, {"b", 4096, 2}, {"c", 3 << 20, 3}, {"d", 40 << 20, 4}, {"e", 100000, 5}};

TEST(PrefixLockTest, SecondDaemonOnALivePrefixIsRefusedAndTheFirstServesOn) {
  absl::StatusOr<TestDaemon> first =
      TestDaemon::Start("prefix-live", {"--host-pool", "128Mi", "--segment-size", "16Mi"});
  ASSERT_OK(first);
  {
    tensorshm::StatusOr<std::shared_ptr<Client>> producer =
        Client::Connect(ClientOptions{first->socket(), "producer"});
    ASSERT_OK(producer);
    for (const Sized& t : kTensors) Put(**producer, t.name, t.bytes, t.seed);
  }
  const std::vector<std::string> objects = ShmObjects(first->shm_prefix());
  ASSERT_GE(objects.size(), 3u);  // lock, control, segments

  // A second daemon on another socket, with the first's prefix.
  const std::string second_log = first->dir() + "/second.log";
  absl::StatusOr<ChildProcess> second =
      ChildProcess::Start({TensorShmdPath(), "--socket", first->dir() + "/second.sock",
                           "--shm-prefix", first->shm_prefix()},
                          second_log);
  ASSERT_OK(second);
  absl::StatusOr<int> status = second->Wait(absl::Seconds(30));
  ASSERT_OK(status);
  const std::string output = second->Output();
  std::cout << "second daemon: " << output;
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0) << *status;
  EXPECT_TRUE(absl::StrContains(output, absl::StrCat("--shm-prefix ", first->shm_prefix())))
      << output;
  EXPECT_TRUE(absl::StrContains(output, absl::StrCat("pid ", first->process().pid()))) << output;
  EXPECT_TRUE(absl::StrContains(output, first->socket())) << output;
  EXPECT_FALSE(absl::StrContains(output, "serving on")) << output;
  EXPECT_FALSE(std::filesystem::exists(first->dir() + "/second.sock"));

  // Every object of the first is still there, and it serves every tensor to a new client (which
  // maps the segments afresh) and takes new ones, a new segment included.
  EXPECT_EQ(ShmObjects(first->shm_prefix()), objects);
  tensorshm::StatusOr<std::shared_ptr<Client>> consumer =
      Client::Connect(ClientOptions{first->socket(), "consumer"});
  ASSERT_OK(consumer);
  for (const Sized& t : kTensors) ExpectTensor(**consumer, t.name, t.bytes, t.seed);
  Put(**consumer, "after", 5 << 20, 9);
  Put(**consumer, "after-big", 20 << 20, 10);
  ExpectTensor(**consumer, "after", 5 << 20, 9);
  ExpectTensor(**consumer, "after-big", 20 << 20, 10);
  tensorshm::StatusOr<std::vector<TensorInfo>> list = (*consumer)->List();
  ASSERT_OK(list);
  EXPECT_EQ(list->size(), kTensors.size() + 2);
}

TEST(PrefixLockTest, AKilledDaemonsPrefixIsRecovered) {
  absl::StatusOr<TestDaemon> first = TestDaemon::Start("prefix-killed");
  ASSERT_OK(first);
  {
    tensorshm::StatusOr<std::shared_ptr<Client>> producer =
        Client::Connect(ClientOptions{first->socket(), "producer"});
    ASSERT_OK(producer);
    for (const Sized& t : kTensors) Put(**producer, t.name, t.bytes, t.seed);
  }
  const pid_t first_pid = first->process().pid();
  first->KillOnPurpose(SIGKILL);
  ASSERT_OK(first->process().Wait(absl::Seconds(30)));
  // The lock file stays, naming the dead holder; its lock went with the process.
  absl::StatusOr<PrefixHolder> holder = ReadPrefixHolder(first->shm_prefix());
  ASSERT_OK(holder);
  EXPECT_EQ(holder->pid, first_pid);
  EXPECT_EQ(holder->socket, first->socket());
  EXPECT_EQ(holder->state, "serving");

  absl::StatusOr<ChildProcess> second =
      ChildProcess::Start({TensorShmdPath(), "--socket", first->dir() + "/second.sock",
                           "--shm-prefix", first->shm_prefix()},
                          first->dir() + "/second.log");
  ASSERT_OK(second);
  ASSERT_TRUE(second->WaitForOutput("serving on", absl::Seconds(20))) << second->Output();
  EXPECT_TRUE(absl::StrContains(second->Output(), "recovered /" + first->shm_prefix()))
      << second->Output();
  absl::StatusOr<PrefixHolder> now = ReadPrefixHolder(first->shm_prefix());
  ASSERT_OK(now);
  EXPECT_EQ(now->pid, second->pid());
  tensorshm::StatusOr<std::shared_ptr<Client>> consumer =
      Client::Connect(ClientOptions{first->dir() + "/second.sock", "consumer"});
  ASSERT_OK(consumer);
  for (const Sized& t : kTensors) ExpectTensor(**consumer, t.name, t.bytes, t.seed);
  consumer->reset();
  // A clean stop removes everything, the lock file too.
  second->Kill(SIGTERM);
  absl::StatusOr<int> status = second->Wait(absl::Seconds(30));
  ASSERT_OK(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << second->Output();
  EXPECT_TRUE(ShmObjects(first->shm_prefix()).empty());
}

// The prefix a daemon started without --shm-prefix logged ("shm prefix /tsm-...").
std::string LoggedPrefix(const std::string& output) {
  const size_t at = output.find("shm prefix /");
  if (at == std::string::npos) return "";
  const size_t start = at + std::strlen("shm prefix /");
  const size_t end = output.find_first_of(";\n ", start);
  return output.substr(start, end - start);
}

TEST(LeftoversTest, ListsAndRemovesAKilledDaemonsObjectsAndNeverALiveOnes) {
  const std::string dir =
      absl::StrCat(std::filesystem::temp_directory_path().string(), "/tsm-leftovers-", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // A daemon with a random prefix, as an operator starts one, killed.
  absl::StatusOr<ChildProcess> dead = ChildProcess::Start(
      {TensorShmdPath(), "--socket", dir + "/dead.sock", "--segment-size", "8Mi"},
      dir + "/dead.log");
  ASSERT_OK(dead);
  ASSERT_TRUE(dead->WaitForOutput("serving on", absl::Seconds(20))) << dead->Output();
  const std::string dead_prefix = LoggedPrefix(dead->Output());
  ASSERT_TRUE(absl::StartsWith(dead_prefix, "tsm-")) << dead->Output();
  {
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{dir + "/dead.sock", "producer"});
    ASSERT_OK(client);
    Put(**client, "x", 12 << 20, 1);  // a segment of its own besides the first
  }
  dead->Kill(SIGKILL);
  ASSERT_OK(dead->Wait(absl::Seconds(30)));
  const std::vector<std::string> dead_objects = ShmObjects(dead_prefix);
  ASSERT_GE(dead_objects.size(), 3u);

  absl::StatusOr<TestDaemon> live = TestDaemon::Start("leftovers-live");
  ASSERT_OK(live);
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{live->socket(), "producer"});
  ASSERT_OK(client);
  Put(**client, "y", 1 << 20, 2);
  const std::vector<std::string> live_objects = ShmObjects(live->shm_prefix());

  // Listed: the dead prefix with each of its objects and its last holder; the live one as live.
  CtlRun run = RunCtl(dir, {"leftovers", "-o", "json"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const nlohmann::json report = run.Json();
  bool listed_dead = false;
  for (const nlohmann::json& entry : report["leftovers"]) {
    EXPECT_NE(entry["prefix"], live->shm_prefix()) << run.out;
    if (entry["prefix"] != dead_prefix) continue;
    listed_dead = true;
    std::vector<std::string> names;
    for (const nlohmann::json& object : entry["objects"]) names.push_back(object["name"]);
    EXPECT_EQ(names, dead_objects) << run.out;
    EXPECT_EQ(entry["last_holder"]["pid"], dead->pid()) << run.out;
    EXPECT_EQ(entry["last_holder"]["socket"], dir + "/dead.sock") << run.out;
    EXPECT_GE(entry["bytes"].get<int64_t>(), 8 << 20) << run.out;
    EXPECT_EQ(entry["removed"], false);
  }
  EXPECT_TRUE(listed_dead) << run.out;
  bool listed_live = false;
  for (const nlohmann::json& entry : report["live"]) {
    if (entry["prefix"] != live->shm_prefix()) continue;
    listed_live = true;
    EXPECT_EQ(entry["holder"]["pid"], live->process().pid()) << run.out;
  }
  EXPECT_TRUE(listed_live) << run.out;
  EXPECT_EQ(ShmObjects(dead_prefix), dead_objects);  // listing removes nothing

  run = RunCtl(dir, {"leftovers", dead_prefix});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::cout << "tensorshmctl leftovers " << dead_prefix << ":\n" << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, absl::StrCat("left by tensorshmd pid ", dead->pid())))
      << run.out;

  // --remove on the live prefix leaves it alone; its daemon serves on.
  run = RunCtl(dir, {"leftovers", "--remove", live->shm_prefix()});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::cout << "tensorshmctl leftovers --remove " << live->shm_prefix() << ":\n" << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, "in use by tensorshmd pid")) << run.out;
  EXPECT_EQ(ShmObjects(live->shm_prefix()), live_objects);

  // --remove on the dead prefix removes every object of it.
  run = RunCtl(dir, {"leftovers", "--remove", dead_prefix, "-o", "json"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  ASSERT_EQ(run.Json()["leftovers"].size(), 1u) << run.out;
  EXPECT_EQ(run.Json()["leftovers"][0]["removed"], true) << run.out;
  EXPECT_TRUE(ShmObjects(dead_prefix).empty());

  // The live daemon's tensors are all there, for a new client too.
  tensorshm::StatusOr<std::shared_ptr<Client>> consumer =
      Client::Connect(ClientOptions{live->socket(), "consumer"});
  ASSERT_OK(consumer);
  ExpectTensor(**consumer, "y", 1 << 20, 2);
  Put(**consumer, "z", 30 << 20, 3);
  ExpectTensor(**consumer, "z", 30 << 20, 3);
  std::filesystem::remove_all(dir);
}

TEST(LeftoversTest, ABadPrefixIsAUsageError) {
  CtlRun run =
      RunCtl(std::filesystem::temp_directory_path().string(), {"leftovers", "../etc/passwd"});
  EXPECT_EQ(run.exit_code, 2) << run.out << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "PREFIX = \"../etc/passwd\"")) << run.err;
}

}  // namespace
}  // namespace tensorshm::testing
