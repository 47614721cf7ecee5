// Load: 20,000 waiting acquires across 50 client processes, 200 sessions churning publishes,
// and an unrelated client timing Stat and Acquire meanwhile. The daemon's threads must not grow
// with waiters or sessions, every waiter must get its tensor (the one first published under its
// name) or DEADLINE_EXCEEDED at its own timeout, and the unrelated client's calls never fail.
// Thread count, RSS and latencies are printed; no assertion is about time.
#include <sys/wait.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizer = true;
#else
constexpr bool kSanitizer = false;
#endif

std::string LoadClientPath() { return TSM_WAITER_LOAD_CLIENT_PATH; }

struct ProcessStatus {
  int64_t threads = -1;
  int64_t rss_kb = -1;        // VmRSS
  int64_t rss_shmem_kb = -1;  // RssShmem: the shared memory it maps (catalog, index), in VmRSS
  int64_t open_files = -1;    // entries of /proc/PID/fd
};

// What /proc/PID/status says; -1 for what is unreadable.
ProcessStatus StatusOf(pid_t pid) {
  std::ifstream file(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  ProcessStatus status;
  while (std::getline(file, line)) {
    std::vector<std::string> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t:"), absl::SkipEmpty());
    if (fields.size() < 2) continue;
    int64_t* field = fields[0] == "Threads"    ? &status.threads
                     : fields[0] == "VmRSS"    ? &status.rss_kb
                     : fields[0] == "RssShmem" ? &status.rss_shmem_kb
                                               : nullptr;
    if (field != nullptr && !absl::SimpleAtoi(fields[1], field)) *field = -1;
  }
  std::error_code error;
  int64_t files = 0;
  for (std::filesystem::directory_iterator it(absl::StrCat("/proc/", pid, "/fd"), error), end;
       !error && it != end; it.increment(error)) {
    ++files;
  }
  if (!error) status.open_files = files;
  return status;
}

// Every "KEY NAME VALUE" line of `output`: NAME -> VALUE.
std::map<std::string, std::string> Pairs(const std::string& output, const std::string& key) {
  std::map<std::string, std::string> pairs;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    std::vector<std::string> fields = absl::StrSplit(line, ' ');
    if (fields.size() == 3 && fields[0] == key) pairs[fields[1]] = fields[2];
  }
  return pairs;
}

TEST(WaiterLoadTest, TwentyThousandWaitersTwoHundredChurningSessionsFewThreads) {
  // Sanitizer builds run a tenth of everything (same shape); the full counts take minutes there.
  const int waiter_processes = kSanitizer ? 10 : 50;
  const int waiters_per_process = kSanitizer ? 200 : 400;
  const int churn_processes = 4;
  const int sessions_per_churner = kSanitizer ? 10 : 50;
  const int iterations = kSanitizer ? 10 : 30;
  const int never_wait_ms = kSanitizer ? 30000 : 15000;
  const int total_waiters = waiter_processes * waiters_per_process;
  if (kSanitizer) {
    std::cout << "sanitizer build: scaled down to " << total_waiters << " waiters in "
              << waiter_processes << " processes and " << churn_processes * sessions_per_churner
              << " churning sessions" << std::endl;
  }

  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
      "waiterload", {"--host-pool", "512Mi", "--segment-size", "64Mi", "--max-tensors", "65536"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const pid_t daemon_pid = daemon->process().pid();

  // The daemon's threads and RSS, sampled for the whole run.
  std::atomic<bool> sampling{true};
  std::atomic<int64_t> max_threads{0}, max_rss_kb{0}, max_shmem_kb{0}, max_files{0};
  const ProcessStatus idle = StatusOf(daemon_pid);
  std::thread sampler([&] {
    while (sampling.load()) {
      const ProcessStatus now = StatusOf(daemon_pid);
      if (now.threads > max_threads.load()) max_threads = now.threads;
      if (now.rss_kb > max_rss_kb.load()) max_rss_kb = now.rss_kb;
      if (now.rss_shmem_kb > max_shmem_kb.load()) max_shmem_kb = now.rss_shmem_kb;
      if (now.open_files > max_files.load()) max_files = now.open_files;
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  // Joined however the test ends (an ASSERT returns early).
  struct JoinOnExit {
    std::atomic<bool>& running;
    std::thread& thread;
    ~JoinOnExit() {
      running = false;
      if (thread.joinable()) thread.join();
    }
  } join_sampler{sampling, sampler};

  // The unrelated client: its tensor, then its timing loop.
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon->socket(), "waiter_load_test"});
  ASSERT_TRUE(client.ok()) << client.status();
  {
    tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLUInt, 8, 1}, {1024}});
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*client)->Publish(*w, "observer/fixed").ok());
  }
  const std::string stop_file = daemon->dir() + "/stop-observer";
  auto start = [&](const std::vector<std::string>& args, const std::string& log) {
    std::vector<std::string> argv = {LoadClientPath(), args.at(0), daemon->socket()};
    argv.insert(argv.end(), args.begin() + 1, args.end());
    absl::StatusOr<ChildProcess> child = ChildProcess::Start(argv, daemon->dir() + "/" + log);
    EXPECT_TRUE(child.ok()) << child.status();
    return std::make_unique<ChildProcess>(*std::move(child));
  };
  std::unique_ptr<ChildProcess> observer =
      start({"observe", "--name", "observer/fixed", "--stop-file", stop_file}, "observer.log");

  const absl::Time began = absl::Now();
  std::vector<std::unique_ptr<ChildProcess>> waiters;
  for (int p = 0; p < waiter_processes; ++p) {
    waiters.push_back(
        start({"waiters", "--first", std::to_string(p * waiters_per_process), "--count",
               std::to_string(waiters_per_process), "--wait-ms", std::to_string(never_wait_ms)},
              absl::StrCat("waiters-", p, ".log")));
  }
  // Publishing starts once every waiter has sent its calls.
  for (auto& waiter : waiters) {
    ASSERT_TRUE(waiter->WaitForOutput("issued ", absl::Seconds(120))) << waiter->Output();
  }
  std::cout << "all " << total_waiters << " acquires sent after "
            << absl::FormatDuration(absl::Now() - began) << "; daemon threads "
            << StatusOf(daemon_pid).threads << std::endl;
  const int per_churner = total_waiters / churn_processes;
  std::vector<std::unique_ptr<ChildProcess>> churners;
  for (int c = 0; c < churn_processes; ++c) {
    churners.push_back(
        start({"churn", "--sessions", std::to_string(sessions_per_churner), "--first",
               std::to_string(c * per_churner), "--count", std::to_string(per_churner),
               "--iterations", std::to_string(iterations), "--tag", std::to_string(c)},
              absl::StrCat("churn-", c, ".log")));
  }

  std::map<std::string, std::string> published;
  for (auto& churner : churners) {
    absl::StatusOr<int> status = churner->Wait(absl::Seconds(600));
    ASSERT_TRUE(status.ok()) << "churner still running";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << churner->Output();
    std::map<std::string, std::string> pairs = Pairs(churner->Output(), "published");
    published.insert(pairs.begin(), pairs.end());
  }
  std::map<std::string, std::string> got;
  for (auto& waiter : waiters) {
    absl::StatusOr<int> status = waiter->Wait(absl::Seconds(600));
    ASSERT_TRUE(status.ok()) << "waiter client still running";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << waiter->Output();
    const std::string summary = Line(waiter->Output(), "waiters");
    EXPECT_EQ(summary, absl::StrCat("got ", waiters_per_process / 2, " expired ",
                                    waiters_per_process / 2, " wrong 0"))
        << waiter->Output();
    std::map<std::string, std::string> pairs = Pairs(waiter->Output(), "got");
    got.insert(pairs.begin(), pairs.end());
  }
  std::ofstream(stop_file).put('\n');
  absl::StatusOr<int> observed = observer->Wait(absl::Seconds(300));
  ASSERT_TRUE(observed.ok()) << "observer still running: " << observer->Output();
  EXPECT_TRUE(WIFEXITED(*observed) && WEXITSTATUS(*observed) == 0) << observer->Output();
  sampling = false;
  sampler.join();

  // Each waiter for a published name got the tensor first published under it.
  EXPECT_EQ(published.size(), static_cast<size_t>(total_waiters / 2));
  EXPECT_EQ(got.size(), static_cast<size_t>(total_waiters / 2));
  int mismatched = 0;
  for (const auto& [name, tensor_id] : published) {
    auto it = got.find(name);
    if (it == got.end() || it->second != tensor_id) {
      if (++mismatched <= 10) {
        ADD_FAILURE() << name << ": published as tensor " << tensor_id << ", waiter got "
                      << (it == got.end() ? "nothing" : it->second);
      }
    }
  }
  EXPECT_EQ(mismatched, 0);

  std::cout << "waiters " << total_waiters << " in " << waiter_processes << " processes, "
            << churn_processes * sessions_per_churner << " churning sessions, run "
            << absl::FormatDuration(absl::Now() - began) << "\n"
            << "daemon threads: idle " << idle.threads << ", max " << max_threads.load()
            << "; VmRSS idle " << idle.rss_kb / 1024 << " MiB, max " << max_rss_kb.load() / 1024
            << " MiB (of which shared memory, max " << max_shmem_kb.load() / 1024
            << " MiB); open files max " << max_files.load() << "\n"
            << Line(observer->Output(), "observer stat") << " (stat)\n"
            << Line(observer->Output(), "observer acquire") << " (acquire)" << std::endl;
  EXPECT_LT(max_threads.load(), 64);
  EXPECT_EQ(Line(observer->Output(), "observer failures"), "0") << observer->Output();
}

}  // namespace
}  // namespace tensorshm::testing
