// Per-uid limits (--uid-sessions, --uid-leases, --uid-waiters, --uid-quota) on a real daemon, as
// a second uid (65534, admitted with --allow-uid): past each limit that uid gets
// RESOURCE_EXHAUSTED naming the limit, the uid, its use and the flag; the daemon's own uid keeps
// its own room meanwhile; and once the second uid's sessions end its room is all back.
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int kNobody = 65534;
const std::string kAllowNobody = std::to_string(kNobody);

#define ASSERT_OK(expr) ASSERT_TRUE((expr).ok()) << (expr).status()

// Starts tsm_uid_client `mode` against `socket`; as `uid` if it is >= 0 (else as this process).
ChildProcess StartClient(const std::string& socket, const std::string& log_dir, int uid,
                         const std::string& mode, std::vector<std::string> args) {
  static int runs = 0;
  std::vector<std::string> argv = {TSM_UID_CLIENT_PATH, mode, socket};
  argv.insert(argv.end(), args.begin(), args.end());
  if (uid >= 0) argv.insert(argv.end(), {"--as-uid", std::to_string(uid)});
  absl::StatusOr<ChildProcess> child = ChildProcess::Start(
      argv, absl::StrCat(log_dir, "/uid-client-", mode, "-", uid, "-", ++runs, ".log"));
  TSM_CHECK(child.ok());
  return *std::move(child);
}

// Runs tsm_uid_client to its end; returns its output ("exit N" appended unless it exited 0).
std::string RunClient(const TestDaemon& daemon, int uid, const std::string& mode,
                      std::vector<std::string> args) {
  ChildProcess child = StartClient(daemon.socket(), daemon.dir(), uid, mode, std::move(args));
  absl::StatusOr<int> status = child.Wait(absl::Seconds(120));
  std::string output = child.Output();
  if (!status.ok() || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
    absl::StrAppend(&output, "exit ", status.ok() ? std::to_string(*status) : "timeout");
  }
  return output;
}

// Waits (bounded) until the daemon has closed every session but `keep` (ended clients' streams
// are noticed asynchronously). A connection of its own is made and dropped for each look.
bool WaitForSessions(const std::string& socket, int64_t keep,
                     const std::shared_ptr<Client>& own = nullptr) {
  for (int i = 0; i < 2000; ++i) {
    tensorshm::StatusOr<ServerStats> stats;
    if (own != nullptr) {
      stats = own->Stat();
    } else {
      tensorshm::StatusOr<std::shared_ptr<Client>> probe =
          Client::Connect(ClientOptions{socket, "uid-limits-probe"});
      if (!probe.ok()) return false;
      stats = (*probe)->Stat();
    }
    // A probe counts itself, and the probes before it may still be closing.
    if (stats.ok() && stats->sessions == keep + (own == nullptr ? 1 : 0)) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

absl::StatusOr<TestDaemon> StartShared(const std::string& name, std::vector<std::string> args) {
  args.insert(args.end(), {"--allow-uid", kAllowNobody, "--segment-size", "4Mi"});
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(name, args);
  // The other uid must reach the socket in the daemon's directory.
  if (daemon.ok()) chmod(daemon->dir().c_str(), 0755);
  return daemon;
}

bool Has(const std::string& output, const std::string& text) {
  return absl::StrContains(output, text);
}

// The lease ids of the line "reattach L: lease_ids A,B,..." in `output`; empty if none.
std::vector<uint64_t> LeaseIds(const std::string& output, int length) {
  std::vector<uint64_t> ids;
  const std::string line = Line(output, absl::StrCat("reattach ", length, ":"));
  absl::string_view rest = line;
  if (!absl::ConsumePrefix(&rest, "lease_ids ")) return ids;
  for (absl::string_view text : absl::StrSplit(rest, ',')) {
    uint64_t id = 0;
    if (!absl::SimpleAtoi(text, &id)) return {};
    ids.push_back(id);
  }
  return ids;
}

TEST(UidLimitsAccessTest, SessionsPastUidSessionsAreRefusedAndComeBackWhenTheyEnd) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534";
  absl::StatusOr<TestDaemon> daemon = StartShared("uid-sessions", {"--uid-sessions", "3"});
  ASSERT_OK(daemon);
  ChildProcess other = StartClient(daemon->socket(), daemon->dir(), kNobody, "sessions",
                                   {"--count", "10", "--hold"});
  ASSERT_TRUE(other.WaitForOutput("\nholding\n", absl::Seconds(60))) << other.Output();
  std::cout << other.Output();
  EXPECT_TRUE(Has(other.Output(), "opened 3\n")) << other.Output();
  EXPECT_TRUE(Has(other.Output(),
                  "refused 8 uid 65534: 3 sessions open, limit 3 (--uid-sessions); end some of "
                  "this uid's clients first"))
      << other.Output();

  // The client library reports the refusal as it came.
  const std::string peer = [&] {
    absl::StatusOr<ChildProcess> child =
        ChildProcess::Start({PeerPath(), "stat", daemon->socket(), "--as-uid", kAllowNobody},
                            daemon->dir() + "/peer-stat.log");
    TSM_CHECK(child.ok());
    (void)child->Wait(absl::Seconds(30));
    return child->Output();
  }();
  EXPECT_TRUE(Has(peer, "error 8 ")) << peer;
  EXPECT_TRUE(Has(peer, "uid 65534: 3 sessions open, limit 3 (--uid-sessions)")) << peer;

  // The daemon's uid opens as many as its own limit allows meanwhile.
  const std::string own = RunClient(*daemon, -1, "sessions", {"--count", "3"});
  EXPECT_TRUE(Has(own, "opened 3\n")) << own;
  EXPECT_FALSE(Has(own, "refused")) << own;

  // Once the other uid's sessions end, it has all its room again.
  other.Kill(SIGKILL);
  ASSERT_TRUE(other.Wait(absl::Seconds(10)).ok());
  ASSERT_TRUE(WaitForSessions(daemon->socket(), 0));
  const std::string again = RunClient(*daemon, kNobody, "sessions", {"--count", "10"});
  EXPECT_TRUE(Has(again, "opened 3\nrefused 8 uid 65534: 3 sessions open")) << again;
}

TEST(UidLimitsAccessTest, LeasesPastUidLeasesAreRefusedAndComeBackWhenReleased) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534";
  absl::StatusOr<TestDaemon> daemon = StartShared("uid-leases", {"--uid-leases", "3"});
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  tensorshm::StatusOr<WritableTensor> w = (*own)->Create({{kDLUInt, 8, 1}, {256}});
  ASSERT_OK(w);
  ASSERT_TRUE((*own)->Publish(*w, "leased").ok());

  ChildProcess other = StartClient(daemon->socket(), daemon->dir(), kNobody, "leases",
                                   {"leased", "--count", "10", "--hold"});
  ASSERT_TRUE(other.WaitForOutput("\nholding\n", absl::Seconds(60))) << other.Output();
  const std::string output = other.Output();
  std::cout << output;
  EXPECT_TRUE(Has(output, "leased 3\n")) << output;
  EXPECT_TRUE(Has(output,
                  "refused 8 uid 65534: 3 leases held, limit 3 (--uid-leases); release some "
                  "acquired tensors first"))
      << output;
  // Publish with acquire is refused whole: nothing was published.
  EXPECT_TRUE(Has(output, "publish-acquire 8 uid 65534: 3 leases held, limit 3 (--uid-leases)"))
      << output;
  EXPECT_EQ((*own)->Acquire("leased-pa").status().code(), tensorshm::StatusCode::kNotFound);
  // A released lease gives its room back at once.
  EXPECT_TRUE(Has(output, "after release 0 ")) << output;

  // The daemon's uid takes its own three RPC leases meanwhile.
  const std::string mine = RunClient(*daemon, -1, "leases", {"leased", "--count", "3"});
  EXPECT_TRUE(Has(mine, "leased 3\n")) << mine;
  EXPECT_FALSE(Has(mine, "refused")) << mine;

  other.Kill(SIGKILL);
  ASSERT_TRUE(other.Wait(absl::Seconds(10)).ok());
  ASSERT_TRUE(WaitForSessions(daemon->socket(), 1, *own));
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = (*own)->List("leased");
  ASSERT_OK(listed);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ(listed->front().leases, 0);  // every lease of the ended sessions went
  const std::string again = RunClient(*daemon, kNobody, "leases", {"leased", "--count", "10"});
  EXPECT_TRUE(Has(again, "leased 3\nrefused 8 uid 65534: 3 leases held")) << again;
}

TEST(UidLimitsAccessTest, WaitersPastUidWaitersAreRefusedAndComeBackWhenWoken) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534";
  absl::StatusOr<TestDaemon> daemon = StartShared("uid-waiters", {"--uid-waiters", "4"});
  ASSERT_OK(daemon);
  ChildProcess other =
      StartClient(daemon->socket(), daemon->dir(), kNobody, "waiters", {"awaited", "--count", "4"});
  ASSERT_TRUE(other.WaitForOutput("waiting", absl::Seconds(60))) << other.Output();
  EXPECT_TRUE(
      Has(other.Output(), "refused 8 uid 65534: 4 acquires waiting, limit 4 (--uid-waiters)"))
      << other.Output();
  // While the other uid waits at its limit, the daemon's uid gets its own four waiters.
  ChildProcess mine =
      StartClient(daemon->socket(), daemon->dir(), -1, "waiters", {"awaited", "--count", "4"});
  ASSERT_TRUE(mine.WaitForOutput("waiting", absl::Seconds(60))) << mine.Output();
  EXPECT_TRUE(Has(mine.Output(), "refused 8 uid 0: 4 acquires waiting, limit 4 (--uid-waiters)"))
      << mine.Output();

  // The publish wakes all eight; then both uids may wait again.
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  tensorshm::StatusOr<WritableTensor> w = (*own)->Create({{kDLFloat, 32, 1}, {16}});
  ASSERT_OK(w);
  ASSERT_TRUE((*own)->Publish(*w, "awaited").ok());
  for (ChildProcess* client : {&other, &mine}) {
    absl::StatusOr<int> status = client->Wait(absl::Seconds(60));
    ASSERT_TRUE(status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << client->Output();
    std::cout << client->Output();
    EXPECT_TRUE(Has(client->Output(), "woken 4 of 4 ok")) << client->Output();
    // DEADLINE_EXCEEDED: admitted as a waiter again, and nobody published the probe name.
    EXPECT_TRUE(Has(client->Output(), "rewait 4 ")) << client->Output();
  }
}

TEST(UidLimitsAccessTest, UnpublishedBytesPastUidQuotaAreRefusedOverAllSessionsOfTheUid) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534";
  absl::StatusOr<TestDaemon> daemon = StartShared("uid-quota", {"--uid-quota", "1Mi"});
  ASSERT_OK(daemon);
  const std::string bytes = std::to_string(600 << 10);
  ChildProcess other = StartClient(daemon->socket(), daemon->dir(), kNobody, "quota",
                                   {"theirs", "--bytes", bytes, "--hold"});
  ASSERT_TRUE(other.WaitForOutput("\nholding\n", absl::Seconds(60))) << other.Output();
  const std::string output = other.Output();
  std::cout << output;
  EXPECT_TRUE(Has(output, "stocked 0 (create 0 ")) << output;  // no stock under a uid quota
  EXPECT_TRUE(Has(output, "create a 0 ")) << output;
  // The second session of the same uid has no quota of its own.
  EXPECT_TRUE(Has(output,
                  "create b 8 uid 65534: 614400 bytes of unpublished tensors held, 614400 more "
                  "requested, limit 1048576 bytes (--uid-quota); publish or drop some first"))
      << output;
  EXPECT_TRUE(Has(output, "after publish 0 ")) << output;
  EXPECT_TRUE(Has(output, "after abandon 0 ")) << output;

  // The daemon's uid has its own megabyte meanwhile (the other holds 600 KiB).
  const std::string mine = RunClient(*daemon, -1, "quota", {"mine", "--bytes", bytes});
  EXPECT_TRUE(Has(mine, "create a 0 ")) << mine;
  EXPECT_TRUE(Has(mine, "create b 8 uid 0: 614400 bytes")) << mine;

  other.Kill(SIGKILL);
  ASSERT_TRUE(other.Wait(absl::Seconds(10)).ok());
  ASSERT_TRUE(WaitForSessions(daemon->socket(), 0));
  const std::string again =
      RunClient(*daemon, kNobody, "quota", {"theirs-again", "--bytes", bytes});
  EXPECT_TRUE(Has(again, "create a 0 ")) << again;
  EXPECT_TRUE(Has(again, "create b 8 uid 65534: 614400 bytes of unpublished tensors held"))
      << again;
  EXPECT_TRUE(Has(again, "after abandon 0 ")) << again;

  // Without a uid quota the same request is stocked: the quota is what stopped it above.
  absl::StatusOr<TestDaemon> unlimited = StartShared("uid-no-quota", {});
  ASSERT_OK(unlimited);
  const std::string stocked = RunClient(*unlimited, kNobody, "quota", {"s", "--bytes", "4096"});
  EXPECT_TRUE(Has(stocked, "stocked 8 (create 0 ")) << stocked;
}

// Removes the shm objects named `prefix`.* and the directory `dir`.
void RemoveLeftovers(const std::string& prefix, const std::string& dir) {
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename().string();
    if (absl::StartsWith(name, prefix + ".")) shm_unlink(("/" + name).c_str());
  }
  std::filesystem::remove_all(dir);
}

// A reconnecting client's held_tensor_ids take back leases only within --uid-leases, and the
// list itself is bounded by it; its unpublished tensors only within --uid-quota.
TEST(UidLimitsAccessTest, ReattachedLeasesAndBuffersCountAgainstTheUid) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534";
  const std::string prefix = absl::StrCat("tsmtest-uid-reattach-", getpid());
  const std::string dir = std::filesystem::temp_directory_path().string() + "/" + prefix;
  RemoveLeftovers(prefix, dir);  // of an earlier run with this pid
  // Whatever happens below, nothing is left behind. Declared before the daemons, so it runs
  // after their destructors have stopped them.
  struct Cleanup {
    std::string prefix, dir;
    ~Cleanup() { RemoveLeftovers(prefix, dir); }
  } cleanup{prefix, dir};
  std::filesystem::create_directories(dir);
  chmod(dir.c_str(), 0755);
  const std::string socket = dir + "/s.sock";
  const std::vector<std::string> base = {TensorShmdPath(), "--socket",       socket, "--shm-prefix",
                                         prefix,           "--host-pool",    "64Mi", "--allow-uid",
                                         kAllowNobody,     "--segment-size", "4Mi"};
  uint64_t published = 0;
  std::vector<std::string> unpublished;
  {
    absl::StatusOr<ChildProcess> first = ChildProcess::Start(base, dir + "/a.log");
    ASSERT_TRUE(first.ok() && first->WaitForOutput("serving on", absl::Seconds(20)));
    tensorshm::StatusOr<std::shared_ptr<Client>> own =
        Client::Connect(ClientOptions{socket, "owner"});
    ASSERT_OK(own);
    tensorshm::StatusOr<WritableTensor> w = (*own)->Create({{kDLUInt, 8, 1}, {4096}});
    ASSERT_OK(w);
    published = w->tensor_id();
    ASSERT_TRUE((*own)->Publish(*w, "kept").ok());
    own->reset();
    // Two unpublished buffers of the daemon's uid, orphaned by the crash below.
    ChildProcess creator =
        StartClient(socket, dir, -1, "create",
                    {"--bytes", std::to_string(600 << 10), "--count", "2", "--hold"});
    ASSERT_TRUE(creator.WaitForOutput("\nholding\n", absl::Seconds(60))) << creator.Output();
    for (absl::string_view line : absl::StrSplit(creator.Output(), '\n')) {
      if (absl::ConsumePrefix(&line, "created ")) unpublished.emplace_back(line);
    }
    ASSERT_EQ(unpublished.size(), 2u) << creator.Output();
    first->Kill(SIGKILL);
    ASSERT_TRUE(first->Wait(absl::Seconds(10)).ok());
    creator.Kill(SIGKILL);
  }
  std::vector<std::string> argv = base;
  argv.insert(argv.end(), {"--recovery-grace", "300", "--uid-leases", "3", "--uid-quota", "1Mi"});
  absl::StatusOr<ChildProcess> daemon = ChildProcess::Start(argv, dir + "/b.log");
  ASSERT_TRUE(daemon.ok() && daemon->WaitForOutput("serving on", absl::Seconds(20)));

  ChildProcess other =
      StartClient(socket, dir, kNobody, "reattach",
                  {"--id", std::to_string(published), "--lists", "3,2,4,r,1", "--hold"});
  ASSERT_TRUE(other.WaitForOutput("\nholding\n", absl::Seconds(60))) << other.Output();
  const std::string output = other.Output();
  std::cout << output;
  std::vector<std::string> lines = absl::StrSplit(output, '\n');
  ASSERT_GE(lines.size(), 5u) << output;
  const std::vector<uint64_t> taken = LeaseIds(lines[0], 3);
  ASSERT_EQ(taken.size(), 3u) << output;
  for (uint64_t id : taken) EXPECT_NE(id, 0u) << output;
  // The uid holds three: a second session takes none back.
  EXPECT_EQ(lines[1], "reattach 2: lease_ids 0,0") << output;
  EXPECT_TRUE(absl::StartsWith(
      lines[2],
      "reattach 4: refused 8 open.held_tensor_ids: 4 entries, more leases than one uid "
      "may hold (limit 3, --uid-leases)"))
      << output;
  // A released lease makes room for one more.
  EXPECT_EQ(lines[3], "released 0 ") << output;
  const std::vector<uint64_t> one_more = LeaseIds(lines[4], 1);
  ASSERT_EQ(one_more.size(), 1u) << output;
  EXPECT_NE(one_more[0], 0u) << output;

  // The daemon's uid takes back three leases of its own, and of its two 600 KiB buffers only
  // the first fits its 1 MiB quota.
  const std::string mine = [&] {
    ChildProcess child =
        StartClient(socket, dir, -1, "reattach",
                    {"--id", std::to_string(published), "--lists", "3", "--unpublished",
                     absl::StrCat(unpublished[0], ",", unpublished[1])});
    (void)child.Wait(absl::Seconds(60));
    return child.Output();
  }();
  const std::vector<uint64_t> mine_taken = LeaseIds(mine, 3);
  ASSERT_EQ(mine_taken.size(), 3u) << mine;
  for (uint64_t id : mine_taken) EXPECT_NE(id, 0u) << mine;
  EXPECT_TRUE(Has(mine, "readopted 1,0\n")) << mine;

  other.Kill(SIGKILL);
  ASSERT_TRUE(other.Wait(absl::Seconds(10)).ok());
  daemon->Kill(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(15)).ok());
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + prefix + ".ctl"));
}

}  // namespace
}  // namespace tensorshm::testing
