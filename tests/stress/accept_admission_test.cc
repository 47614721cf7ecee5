// Admission before resources (issue 22, finding 3): on a real daemon, connections of a uid that
// is not admitted are closed at accept, however many (but the 4 it may hold to be answered
// PERMISSION_DENIED); an admitted uid past --uid-connections is
// refused at accept while its sessions keep working; the daemon's own uid is held to neither;
// and what the daemon's open file limit allows is never all taken by connections. The attacker
// is tsm_conn_flood, run as uid 12345 (not admitted) or 65534 (admitted with --allow-uid).
#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int kStranger = 12345;
constexpr int kNobody = 65534;

#define ASSERT_OK(expr) ASSERT_TRUE((expr).ok()) << (expr).status()

template <typename Daemon>
ChildProcess StartFlood(const Daemon& daemon, int64_t count, std::vector<std::string> args) {
  static int runs = 0;
  std::vector<std::string> argv = {TSM_CONN_FLOOD_PATH, daemon.socket(), std::to_string(count)};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<ChildProcess> child =
      ChildProcess::Start(argv, absl::StrCat(daemon.dir(), "/flood-", ++runs, ".log"));
  TSM_CHECK(child.ok());
  return *std::move(child);
}

// Runs tsm_conn_flood to its end; its output, with "exit N" appended unless it exited 0.
std::string RunFlood(const TestDaemon& daemon, int64_t count, std::vector<std::string> args) {
  ChildProcess child = StartFlood(daemon, count, std::move(args));
  absl::StatusOr<int> status = child.Wait(absl::Seconds(120));
  std::string output = child.Output();
  if (!status.ok() || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
    absl::StrAppend(&output, "exit ", status.ok() ? std::to_string(*status) : "timeout");
  }
  return output;
}

// From "closed K of C in MS ms": {K, C}; {-1, -1} if the line is missing.
std::pair<int64_t, int64_t> Closed(const std::string& output) {
  std::vector<std::string> words = absl::StrSplit(Line(output, "closed"), ' ');
  int64_t closed = -1, of = -1;
  if (words.size() < 3 || !absl::SimpleAtoi(words[0], &closed) ||
      !absl::SimpleAtoi(words[2], &of)) {
    return {-1, -1};
  }
  return {closed, of};
}

absl::StatusOr<TestDaemon> StartShared(const std::string& name, std::vector<std::string> args) {
  args.insert(args.end(), {"--allow-uid", std::to_string(kNobody), "--segment-size", "4Mi",
                           "--metrics", "127.0.0.1:0"});
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(name, args);
  // The other uids must reach the socket in the daemon's directory.
  if (daemon.ok()) chmod(daemon->dir().c_str(), 0755);
  return daemon;
}

// Lines of the daemon's log that mention `text`.
template <typename Daemon>
int LogLines(Daemon& daemon, const std::string& text) {
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(daemon.process().Output(), '\n')) {
    lines += absl::StrContains(line, text) ? 1 : 0;
  }
  return lines;
}

int OpenDescriptors(pid_t pid) {
  int count = 0;
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  while (readdir(dir) != nullptr) ++count;
  closedir(dir);
  return count - 2;
}

// Puts a tensor through `client` and reads it back (a create, a segment grant, a publish, an
// acquire); the error otherwise.
tensorshm::Status PutAndGet(Client& client, const std::string& name) {
  tensorshm::StatusOr<WritableTensor> w = client.Create({{kDLUInt, 8, 1}, {1 << 20}});
  if (!w.ok()) return w.status();
  std::memset(w->data(), 0x5a, 1 << 20);
  if (tensorshm::Status s = client.Publish(*w, name, true); !s.ok()) return s;
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = client.Acquire(name);
  if (!t.ok()) return t.status();
  const auto* bytes = static_cast<const uint8_t*>((*t)->dl_tensor.data);
  const bool same = bytes[0] == 0x5a && bytes[(1 << 20) - 1] == 0x5a;
  (*t)->deleter(*t);
  return same ? tensorshm::Status()
              : tensorshm::Status(tensorshm::StatusCode::kDataLoss, name + ": wrong bytes");
}

// Stat of `client` in a loop until `stop`; each call's duration.
std::vector<absl::Duration> StatLoop(Client& client, const std::atomic<bool>& stop,
                                     std::atomic<int>& failures) {
  std::vector<absl::Duration> took;
  while (!stop.load()) {
    const absl::Time start = absl::Now();
    if (!client.Stat().ok()) ++failures;
    took.push_back(absl::Now() - start);
    absl::SleepFor(absl::Milliseconds(1));
  }
  return took;
}

absl::Duration Median(std::vector<absl::Duration> took) {
  if (took.empty()) return absl::InfiniteDuration();
  std::sort(took.begin(), took.end());
  return took[took.size() / 2];
}

TEST(AcceptAdmissionTest, TwentyThousandConnectionsOfAStrangerAreClosedAtAccept) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the flood as uid 12345";
  absl::StatusOr<TestDaemon> daemon = StartShared("accept-stranger", {});
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> owner =
      Client::Connect(ClientOptions{daemon->socket(), "accept-owner"});
  ASSERT_OK(owner);
  ASSERT_TRUE(PutAndGet(**owner, "before").ok());
  const int descriptors_before = OpenDescriptors(daemon->process().pid());

  // Two processes of the stranger, 10,000 connections each, while the owner's Stat runs.
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::vector<absl::Duration> took;
  std::thread stats([&] { took = StatLoop(**owner, stop, failures); });
  const absl::Time flood_start = absl::Now();
  std::vector<ChildProcess> floods;
  for (int i = 0; i < 2; ++i) {
    floods.push_back(StartFlood(*daemon, 10000,
                                {"--as-uid", std::to_string(kStranger), "--open-files", "10100",
                                 "--preface", "--wait-closed", "5", "--hold"}));
  }
  for (ChildProcess& flood : floods) {
    ASSERT_TRUE(flood.WaitForOutput("holding\n", absl::Seconds(90))) << flood.Output();
  }
  const absl::Duration flood_took = absl::Now() - flood_start;
  // New clients get in while the stranger holds its (closed) connections; segment grants work.
  tensorshm::StatusOr<std::shared_ptr<Client>> late =
      Client::Connect(ClientOptions{daemon->socket(), "accept-late"});
  ASSERT_OK(late);
  EXPECT_TRUE(PutAndGet(**late, "late").ok());
  EXPECT_TRUE(PutAndGet(**owner, "during").ok());
  const int descriptors_during = OpenDescriptors(daemon->process().pid());
  stop = true;
  stats.join();

  // Every connection was closed by the daemon, promptly, but the 4 of the uid held to be
  // answered PERMISSION_DENIED.
  int64_t closed_in_all = 0;
  for (ChildProcess& flood : floods) {
    std::cout << flood.Output();
    EXPECT_TRUE(absl::StrContains(flood.Output(), "connected 10000 failed 0")) << flood.Output();
    const auto [closed, of] = Closed(flood.Output());
    EXPECT_EQ(of, 10000) << flood.Output();
    closed_in_all += closed;
  }
  EXPECT_GE(closed_in_all, 20000 - 4);
  const absl::Duration median = Median(took);
  const absl::Duration slowest =
      took.empty() ? absl::ZeroDuration() : *std::max_element(took.begin(), took.end());
  std::cout << "flood of 20000 took " << flood_took << "; owner's Stat: " << took.size()
            << " calls, median " << median << ", slowest " << slowest << ", " << failures.load()
            << " failed; daemon fds " << descriptors_before << " before, " << descriptors_during
            << " during\n";
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LT(median, absl::Milliseconds(10));
  // The stranger's descriptors are not held: a few more than before at most (the late client).
  EXPECT_LT(descriptors_during, descriptors_before + 64);

  // The log says so, in a bounded number of lines: one, then a count every 10 s at most.
  const int lines = LogLines(*daemon, absl::StrCat("uid ", kStranger));
  std::cout << "log lines about uid " << kStranger << ": " << lines << "\n";
  EXPECT_GE(lines, 1);
  EXPECT_LE(lines, 2 + absl::ToInt64Seconds(absl::Now() - flood_start) / 10);
  EXPECT_TRUE(
      absl::StrContains(daemon->process().Output(), "connection refused at accept: uid 12345"))
      << daemon->process().Output();
}

TEST(AcceptAdmissionTest, AnAdmittedUidPastUidConnectionsIsRefusedAndItsSessionsKeepWorking) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the flood as uid 65534";
  absl::StatusOr<TestDaemon> daemon = StartShared("accept-uid-cap", {"--uid-connections", "10"});
  ASSERT_OK(daemon);
  // A session of uid 65534 (two connections), then 20 raw connections: 8 fit, 12 are closed.
  const std::string output = RunFlood(*daemon, 20,
                                      {"--as-uid", std::to_string(kNobody), "--preface", "--client",
                                       "--wait-closed", "3", "--reconnect"});
  std::cout << output;
  EXPECT_TRUE(absl::StrContains(output, "client ok")) << output;
  EXPECT_TRUE(absl::StrContains(output, "connected 20 failed 0")) << output;
  const auto [closed, of] = Closed(output);
  EXPECT_EQ(of, 20) << output;
  // The client holds at least 2 of the 10; none of the flood's over the 10 stays open.
  EXPECT_GE(closed, 12) << output;
  EXPECT_LT(closed, 20) << output;
  EXPECT_TRUE(absl::StrContains(output, "after ok")) << output;
  // Once the flood's connections are closed, the uid's room is back.
  EXPECT_TRUE(absl::StrContains(output, "reconnect ok")) << output;
  EXPECT_TRUE(absl::StrContains(daemon->process().Output(),
                                "uid 65534 has 10 connections open, limit 10 (--uid-connections)"))
      << daemon->process().Output();
  EXPECT_LE(LogLines(*daemon, "(--uid-connections)"), 3);

  // The daemon's own uid is not held to --uid-connections.
  const std::string own = RunFlood(*daemon, 30, {"--preface", "--wait-closed", "1"});
  std::cout << own;
  EXPECT_TRUE(absl::StrContains(own, "connected 30 failed 0")) << own;
  EXPECT_EQ(Closed(own).first, 0) << own;
}

// A session whose gRPC connection fits under --uid-connections but whose memory channel does not:
// the daemon serves the session all along, so the calls that need the channel (a create maps
// its segment through it) fail with an error that says why, at once, rather than waiting out
// the call's deadline (kCallTimeout, 60 s) for a restart that is not coming.
TEST(AcceptAdmissionTest, ASessionWhoseMemoryChannelIsRefusedIsToldSoPromptly) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the clients as uid 65534";
  absl::StatusOr<TestDaemon> daemon = StartShared("accept-channel-cap", {"--uid-connections", "3"});
  ASSERT_OK(daemon);
  // Two connections of the uid held open: its next (the client's gRPC) is the last that fits.
  ChildProcess holder = StartFlood(
      *daemon, 2,
      {"--as-uid", std::to_string(kNobody), "--preface", "--wait-closed", "1", "--hold"});
  ASSERT_TRUE(holder.WaitForOutput("holding\n", absl::Seconds(30))) << holder.Output();
  ASSERT_TRUE(absl::StrContains(holder.Output(), "closed 0 of 2")) << holder.Output();

  const absl::Time start = absl::Now();
  const std::string output =
      RunFlood(*daemon, 0, {"--as-uid", std::to_string(kNobody), "--client"});
  const absl::Duration took = absl::Now() - start;
  std::cout << output << "took " << took << "\n";
  EXPECT_TRUE(absl::StrContains(output, "error put: UNAVAILABLE")) << output;
  EXPECT_TRUE(absl::StrContains(output, "closed the connection before answering its bind"))
      << output;
  EXPECT_TRUE(absl::StrContains(output, "--uid-connections")) << output;
  EXPECT_LT(took, absl::Seconds(30));  // half the call deadline
  EXPECT_TRUE(absl::StrContains(daemon->process().Output(),
                                "uid 65534 has 3 connections open, limit 3 (--uid-connections)"))
      << daemon->process().Output();
  // The daemon serves its own uid meanwhile.
  tensorshm::StatusOr<std::shared_ptr<Client>> owner =
      Client::Connect(ClientOptions{daemon->socket(), "accept-channel-owner"});
  ASSERT_OK(owner);
  EXPECT_TRUE(PutAndGet(**owner, "owner").ok());
}

// A tensorshmd started under `prlimit --nofile=N:N` (this process cannot lower its own limit and
// raise it back: no CAP_SYS_RESOURCE here), in a directory of its own; stopped and cleaned up
// when it goes.
class LimitedDaemon {
 public:
  LimitedDaemon(const std::string& name, int open_files, std::vector<std::string> args) {
    prefix_ = absl::StrCat("tsmtest-", name, "-", getpid());
    dir_ = absl::StrCat("/tmp/", prefix_);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    chmod(dir_.c_str(), 0755);
    socket_ = dir_ + "/tensorshm.sock";
    std::vector<std::string> argv = {"/usr/bin/prlimit",
                                     absl::StrCat("--nofile=", open_files, ":", open_files),
                                     TensorShmdPath(),
                                     "--socket",
                                     socket_,
                                     "--shm-prefix",
                                     prefix_};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<ChildProcess> child = ChildProcess::Start(argv, dir_ + "/daemon.log");
    TSM_CHECK(child.ok());
    process_ = std::make_unique<ChildProcess>(*std::move(child));
  }
  ~LimitedDaemon() {
    process_->Kill(SIGTERM);
    if (!process_->Wait(absl::Seconds(10)).ok()) process_->Kill(SIGKILL);
    std::filesystem::remove_all(dir_);
  }
  bool WaitServing() { return process_->WaitForOutput("serving on", absl::Seconds(20)); }
  const std::string& socket() const { return socket_; }
  const std::string& dir() const { return dir_; }
  ChildProcess& process() { return *process_; }

 private:
  std::string prefix_, dir_, socket_;
  std::unique_ptr<ChildProcess> process_;
};

TEST(AcceptAdmissionTest, ConnectionsNeverTakeTheDescriptorsSessionsNeed) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the flood as uid 65534";
  // A daemon with 600 open files: at most (600 - 64) / 3 * 2 = 356 connections, the last 44 for
  // its own uid.
  LimitedDaemon daemon_storage(
      "accept-daemon-cap", 600,
      {"--allow-uid", std::to_string(kNobody), "--uid-connections", "0", "--segment-size", "4Mi"});
  LimitedDaemon* daemon = &daemon_storage;
  ASSERT_TRUE(daemon->WaitServing()) << daemon->process().Output();
  EXPECT_TRUE(absl::StrContains(daemon->process().Output(),
                                "connections: at most 356 open at once (of 600 open files), the "
                                "last 44 for uid 0 alone"))
      << daemon->process().Output();
  tensorshm::StatusOr<std::shared_ptr<Client>> owner =
      Client::Connect(ClientOptions{daemon->socket(), "accept-owner"});
  ASSERT_OK(owner);

  ChildProcess flood = StartFlood(
      *daemon, 500,
      {"--as-uid", std::to_string(kNobody), "--preface", "--wait-closed", "3", "--hold"});
  ASSERT_TRUE(flood.WaitForOutput("holding\n", absl::Seconds(60))) << flood.Output();
  std::cout << flood.Output();
  const auto [closed, of] = Closed(flood.Output());
  EXPECT_EQ(of, 500);
  // 312 at most fit (the owner's client holds 2 of them): the rest were closed at accept.
  EXPECT_GE(closed, 500 - 312) << flood.Output();
  EXPECT_LE(closed, 500 - 300) << flood.Output();

  // The owner's session works (segment grants included), and new clients of its uid get in.
  EXPECT_TRUE(PutAndGet(**owner, "owner").ok());
  tensorshm::StatusOr<std::shared_ptr<Client>> late =
      Client::Connect(ClientOptions{daemon->socket(), "accept-late"});
  ASSERT_OK(late);
  EXPECT_TRUE(PutAndGet(**late, "late").ok());
  const int descriptors = OpenDescriptors(daemon->process().pid());
  std::cout << "daemon fds with the flood held: " << descriptors << " of 600\n";
  EXPECT_LT(descriptors, 600 - 64);
  EXPECT_TRUE(absl::StrContains(daemon->process().Output(), "(--uid-connections)") ||
              absl::StrContains(daemon->process().Output(), "limit 356"))
      << daemon->process().Output();
  EXPECT_LE(LogLines(*daemon, "refused at accept"), 3);
}

TEST(AcceptAdmissionTest, AnAdmittedUidHoldsOneReflectionStreamAndNeverTheLastThread) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the client as uid 65534";
  absl::StatusOr<TestDaemon> daemon = StartShared("accept-reflection", {});
  ASSERT_OK(daemon);
  // Reflection has 4 synchronous threads: uid 65534 asks for 4 streams and gets 1.
  ChildProcess other =
      StartFlood(*daemon, 0, {"--as-uid", std::to_string(kNobody), "--reflection", "4", "--hold"});
  ASSERT_TRUE(other.WaitForOutput("holding\n", absl::Seconds(60))) << other.Output();
  std::cout << other.Output();
  EXPECT_TRUE(absl::StrContains(other.Output(), "reflection answered 1 of 4")) << other.Output();
  // The daemon's own uid finds the others free (gRPC keeps one of the 4 polling).
  ChildProcess own = StartFlood(*daemon, 0, {"--reflection", "2", "--hold"});
  ASSERT_TRUE(own.WaitForOutput("holding\n", absl::Seconds(60))) << own.Output();
  std::cout << own.Output();
  EXPECT_TRUE(absl::StrContains(own.Output(), "reflection answered 2 of 2")) << own.Output();
  // A stranger cannot open one at all (its connection is closed at accept).
  ChildProcess stranger = StartFlood(
      *daemon, 0, {"--as-uid", std::to_string(kStranger), "--reflection", "1", "--hold"});
  ASSERT_TRUE(stranger.WaitForOutput("holding\n", absl::Seconds(60))) << stranger.Output();
  EXPECT_TRUE(absl::StrContains(stranger.Output(), "reflection answered 0 of 1"))
      << stranger.Output();
}

}  // namespace
}  // namespace tensorshm::testing
