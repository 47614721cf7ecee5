// --shm-group: the host pool's named segments are mode 0660 with one group, so that a server that
// opens shm objects by name (Triton's system shared memory: shm_open O_RDWR, mmap read-write) can
// register them; the control segment and the lock stay 0600. Bad values are refused at start, and
// a restarted daemon takes a group's segments back only with that group. Real daemons, and
// tsm_shm_open run as uid 65534 in and out of the group (setpriv).
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/raw_session.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

#define ASSERT_OK(expr) ASSERT_TRUE((expr).ok()) << (expr).status()

constexpr uid_t kNobody = 65534;
// Groups the segments are given to: root gives an object to any gid, named or not.
constexpr gid_t kGroup = 4242;
constexpr gid_t kOtherGroup = 4343;

// What the daemon calls group `gid`: its name, or its number where it has none.
std::string GroupName(gid_t gid) {
  const struct group* found = getgrgid(gid);
  return found != nullptr ? found->gr_name : std::to_string(gid);
}

// The /dev/shm entries of `prefix` ("<prefix>.cpu.1", "<prefix>.ctl", ...), with their stat.
std::map<std::string, struct stat> ShmObjects(const std::string& prefix) {
  std::map<std::string, struct stat> objects;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename().string();
    struct stat st;
    if (absl::StartsWith(name, prefix + ".") && lstat(entry.path().c_str(), &st) == 0) {
      objects[name] = st;
    }
  }
  return objects;
}

// Every host segment of `prefix` is a regular file owned by `uid`, mode 0660, group `gid`; the
// control segment and the lock file stay 0600. Returns the number of segments.
int ExpectGroupSegments(const std::string& prefix, uid_t uid, gid_t gid) {
  int segments = 0;
  for (const auto& [name, st] : ShmObjects(prefix)) {
    const mode_t mode = st.st_mode & 07777;
    EXPECT_TRUE(S_ISREG(st.st_mode)) << name;
    EXPECT_EQ(st.st_uid, uid) << name;
    if (absl::StartsWith(name, prefix + ".cpu.")) {
      ++segments;
      EXPECT_EQ(mode, 0660u) << name << ": mode " << std::oct << mode;
      EXPECT_EQ(st.st_gid, gid) << name;
    } else {
      EXPECT_EQ(mode, 0600u) << name << ": mode " << std::oct << mode;
    }
  }
  return segments;
}

bool CanRunAsOtherUids(std::string* why) {
  if (geteuid() != 0) {
    *why = "needs root to give segments to a group it is not in and to run processes as uid 65534";
    return false;
  }
  if (access("/usr/bin/setpriv", X_OK) != 0) {
    *why = "needs /usr/bin/setpriv";
    return false;
  }
  return true;
}

// The words that run a command as uid 65534 with `groups` (none: --clear-groups).
std::vector<std::string> AsNobody(const std::vector<gid_t>& groups) {
  std::vector<std::string> argv = {"/usr/bin/setpriv", absl::StrCat("--reuid=", kNobody),
                                   absl::StrCat("--regid=", kNobody)};
  if (groups.empty()) {
    argv.push_back("--clear-groups");
  } else {
    std::string list;
    for (gid_t g : groups) absl::StrAppend(&list, list.empty() ? "" : ",", g);
    argv.push_back("--groups=" + list);
  }
  return argv;
}

struct Exit {
  int code = -1;  // -1: killed, or still running after the limit
  std::string output;
};

// Runs `argv` to its end, its output going to `log`.
Exit RunProcess(const std::vector<std::string>& argv, const std::string& log) {
  absl::StatusOr<ChildProcess> child = ChildProcess::Start(argv, log);
  if (!child.ok()) return {-1, child.status().ToString()};
  absl::StatusOr<int> status = child->Wait(absl::Seconds(60));
  Exit exit{-1, child->Output()};
  if (status.ok() && WIFEXITED(*status)) exit.code = WEXITSTATUS(*status);
  return exit;
}

// SIGTERMs a daemon, which must exit 0 (removing its segments).
void ExpectCleanStop(ChildProcess& daemon) {
  daemon.Kill(SIGTERM);
  absl::StatusOr<int> status = daemon.Wait(absl::Seconds(60));
  ASSERT_OK(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << daemon.Output();
}

// tsm_shm_open NAME [args...] as uid 65534 with `groups`.
Exit OpenAsNobody(const std::vector<gid_t>& groups, const std::vector<std::string>& args,
                  const std::string& log) {
  std::vector<std::string> argv = AsNobody(groups);
  argv.push_back(TSM_SHM_OPEN_PATH);
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv, log);
}

// Publishes `bytes` bytes of value i * 7 + 1 as `name`.
void PutPattern(const std::string& socket, const std::string& name, size_t bytes) {
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{socket, "put"});
  ASSERT_OK(client);
  tensorshm::StatusOr<WritableTensor> w =
      (*client)->Create({{kDLUInt, 8, 1}, {static_cast<int64_t>(bytes)}});
  ASSERT_OK(w);
  auto* data = static_cast<uint8_t*>(w->data());
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_TRUE((*client)->Publish(*w, name).ok());
}

// Whether `name`'s `bytes` bytes are the pattern PutPattern wrote, or all `fill` if given.
void ExpectBytes(const std::string& socket, const std::string& name, size_t bytes, int fill = -1) {
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{socket, "get"});
  ASSERT_OK(client);
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire(name);
  ASSERT_OK(t);
  const auto* data = static_cast<const uint8_t*>((*t)->dl_tensor.data);
  size_t wrong = 0;
  for (size_t i = 0; i < bytes; ++i) {
    const uint8_t expected =
        fill >= 0 ? static_cast<uint8_t>(fill) : static_cast<uint8_t>(i * 7 + 1);
    wrong += data[i] != expected ? 1 : 0;
  }
  EXPECT_EQ(wrong, 0u) << name << ": bytes differ";
  (*t)->deleter(*t);
  EXPECT_TRUE((*client)->Flush().ok());
}

void ExpectAll(const std::string& text, const std::vector<std::string>& parts) {
  for (const std::string& part : parts) {
    EXPECT_TRUE(absl::StrContains(text, part)) << "missing \"" << part << "\" in: " << text;
  }
}

// ---- Modes ----

TEST(ShmGroupTest, HostSegmentsAre0660WithTheGroupTheRestStays0600) {
  std::string why;
  if (!CanRunAsOtherUids(&why)) GTEST_SKIP() << why;
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
      "group-modes",
      {"--shm-group", std::to_string(kGroup), "--host-pool", "64Mi", "--segment-size", "4Mi"});
  ASSERT_OK(daemon);
  // A tensor larger than --segment-size takes a segment of its own size: a second object.
  PutPattern(daemon->socket(), "small", 4096);
  PutPattern(daemon->socket(), "large", 6 << 20);
  const std::map<std::string, struct stat> objects = ShmObjects(daemon->shm_prefix());
  EXPECT_EQ(ExpectGroupSegments(daemon->shm_prefix(), geteuid(), kGroup), 2);
  EXPECT_EQ(objects.count(daemon->shm_prefix() + ".ctl"), 1u);
  EXPECT_EQ(objects.count(daemon->shm_prefix() + ".lock"), 1u);
  // The start-up line says so.
  const std::string log = daemon->process().Output();
  std::cout << log;
  ExpectAll(log, {absl::StrCat("host segments group-accessible: mode 0660, group ",
                               GroupName(kGroup), " (gid ", kGroup, ", --shm-group)")});
  ExpectBytes(daemon->socket(), "large", 6 << 20);
}

TEST(ShmGroupTest, WithoutTheOptionNothingChanges) {
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start("group-none", {"--host-pool", "64Mi"});
  ASSERT_OK(daemon);
  PutPattern(daemon->socket(), "small", 4096);
  int segments = 0;
  for (const auto& [name, st] : ShmObjects(daemon->shm_prefix())) {
    EXPECT_EQ(st.st_mode & 07777, 0600u) << name;
    segments += absl::StartsWith(name, daemon->shm_prefix() + ".cpu.") ? 1 : 0;
  }
  EXPECT_GE(segments, 1);
  EXPECT_FALSE(absl::StrContains(daemon->process().Output(), "group-accessible"));
}

// ---- Opening by name, as Triton does ----

TEST(ShmGroupTest, AMemberOpensASegmentReadWriteByNameAndOthersCannot) {
  std::string why;
  if (!CanRunAsOtherUids(&why)) GTEST_SKIP() << why;
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
      "group-open", {"--shm-group", std::to_string(kGroup), "--host-pool", "64Mi"});
  ASSERT_OK(daemon);
  const std::string dir = daemon->dir();
  chmod(dir.c_str(), 0755);  // uid 65534 writes nothing there; its logs are opened by root

  // An output buffer: the producer creates it, the server (another uid in the group) writes it
  // through the segment it opened by name, the producer publishes it.
  RawSession session(daemon->socket(), "producer");
  v1::CreateResponse created;
  ASSERT_TRUE(session.Create(8192, &created).ok());
  const std::string segment = created.location().host().shm_name();
  const std::string offset = std::to_string(created.location().offset());
  ASSERT_TRUE(absl::StartsWith(segment, absl::StrCat("/", daemon->shm_prefix(), ".cpu.")))
      << segment;
  Exit member =
      OpenAsNobody({kGroup}, {segment, offset, "8192", "fill", "0x5a"}, dir + "/member.log");
  std::cout << member.output;
  EXPECT_EQ(member.code, 0) << member.output;
  ExpectAll(member.output, {"mapped " + segment, "filled 8192 bytes"});
  ASSERT_TRUE(session.PublishTensor(created.tensor_id(), "from-server").ok());
  ExpectBytes(daemon->socket(), "from-server", 8192, 0x5a);

  // An input: a published tensor read through the same mapping.
  Exit reader =
      OpenAsNobody({kGroup}, {segment, offset, "8192", "expect", "0x5a"}, dir + "/reader.log");
  EXPECT_EQ(reader.code, 0) << reader.output;

  // A uid outside the group cannot open it, read-write or at all (the helper asks O_RDWR, as
  // Triton does; mode 0660 gives others nothing).
  Exit stranger = OpenAsNobody({}, {segment}, dir + "/stranger.log");
  std::cout << stranger.output;
  EXPECT_EQ(stranger.code, 3) << stranger.output;
  ExpectAll(stranger.output, {"shm_open(" + segment + ", O_RDWR): Permission denied"});
  Exit other_group = OpenAsNobody({kOtherGroup}, {segment}, dir + "/other-group.log");
  EXPECT_EQ(other_group.code, 3) << other_group.output;

  // The control segment stays the daemon's alone, for members too.
  const std::string control = absl::StrCat("/", daemon->shm_prefix(), ".ctl");
  Exit catalog = OpenAsNobody({kGroup}, {control}, dir + "/control.log");
  EXPECT_EQ(catalog.code, 3) << catalog.output;
  ExpectAll(catalog.output, {"shm_open(" + control + ", O_RDWR): Permission denied"});
}

// ---- Refusals at start ----

class ShmGroupRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = absl::StrCat("tsmtest-group-refused-", getpid());
    dir_ = absl::StrCat(std::filesystem::temp_directory_path().string(), "/", prefix_);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    chmod(dir_.c_str(), 0755);
    RemoveObjects();
  }
  void TearDown() override {
    RemoveObjects();
    std::filesystem::remove_all(dir_);
  }
  void RemoveObjects() {
    for (const auto& [name, st] : ShmObjects(prefix_)) std::filesystem::remove("/dev/shm/" + name);
  }
  std::vector<std::string> Daemon(const std::vector<std::string>& extra,
                                  const std::string& socket_dir = "") const {
    std::vector<std::string> argv = {TensorShmdPath(), "--socket",
                                     (socket_dir.empty() ? dir_ : socket_dir) + "/s.sock",
                                     "--shm-prefix", prefix_};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }

  std::string prefix_;
  std::string dir_;
};

TEST_F(ShmGroupRefusalTest, AnUnknownGroupOrMemfdSegmentsAreRefused) {
  Exit unknown = RunProcess(Daemon({"--shm-group", "tsm-nosuchgroup"}), dir_ + "/unknown.log");
  std::cout << unknown.output;
  EXPECT_EQ(unknown.code, 2) << unknown.output;
  ExpectAll(unknown.output, {"--shm-group = \"tsm-nosuchgroup\": no such group"});

  Exit empty = RunProcess(Daemon({"--shm-group", ""}), dir_ + "/empty.log");
  EXPECT_EQ(empty.code, 2) << empty.output;
  ExpectAll(empty.output, {"--shm-group = \"\""});

  Exit memfd = RunProcess(Daemon({"--shm-group", std::to_string(getegid()), "--segments", "memfd"}),
                          dir_ + "/memfd.log");
  std::cout << memfd.output;
  EXPECT_EQ(memfd.code, 2) << memfd.output;
  ExpectAll(memfd.output, {"--shm-group = \"", "with --segments memfd", "have no name",
                           "opens segments by name"});

  // From a --config file: the file and the key are named.
  const std::string config = dir_ + "/tensorshmd.toml";
  std::ofstream(config) << "shm-group = \"tsm-nosuchgroup\"\n";
  Exit from_file = RunProcess(Daemon({"--config", config}), dir_ + "/config.log");
  EXPECT_EQ(from_file.code, 2) << from_file.output;
  ExpectAll(from_file.output,
            {"--config " + config + ": --shm-group = \"tsm-nosuchgroup\": no such group"});
  EXPECT_TRUE(ShmObjects(prefix_).empty()) << "a refused daemon made shm objects";
}

// A daemon that is neither root nor in the group cannot give its segments to it: refused before
// it makes anything. In the group (not root) it can.
TEST_F(ShmGroupRefusalTest, ADaemonOutsideTheGroupIsRefusedAMemberIsNot) {
  std::string why;
  if (!CanRunAsOtherUids(&why)) GTEST_SKIP() << why;
  const std::string run = dir_ + "/nobody";
  ASSERT_EQ(mkdir(run.c_str(), 0700), 0);
  ASSERT_EQ(chown(run.c_str(), kNobody, kNobody), 0);
  std::vector<std::string> argv = AsNobody({});
  for (const std::string& arg : Daemon({"--shm-group", std::to_string(kGroup)}, run)) {
    argv.push_back(arg);
  }
  Exit outside = RunProcess(argv, dir_ + "/outside.log");
  std::cout << outside.output;
  EXPECT_EQ(outside.code, 1) << outside.output;
  ExpectAll(outside.output,
            {absl::StrCat("--shm-group = \"", GroupName(kGroup), "\" (gid ", kGroup, ")"),
             "runs as uid 65534", "neither a member of that group nor root", "usermod -aG",
             "run tensorshmd as root"});
  EXPECT_TRUE(ShmObjects(prefix_).empty()) << "a refused daemon made shm objects";

  argv = AsNobody({kGroup});
  for (const std::string& arg : Daemon({"--shm-group", std::to_string(kGroup)}, run)) {
    argv.push_back(arg);
  }
  absl::StatusOr<ChildProcess> member = ChildProcess::Start(argv, dir_ + "/member.log");
  ASSERT_OK(member);
  ASSERT_TRUE(member->WaitForOutput("serving on", absl::Seconds(20))) << member->Output();
  EXPECT_EQ(ExpectGroupSegments(prefix_, kNobody, kGroup), 1);
  ExpectCleanStop(*member);
  EXPECT_TRUE(ShmObjects(prefix_).empty());
}

// ---- Recovery ----

// Publishes "kept" (64 KiB) in `daemon`, then SIGKILLs it: its segments stay for a restart.
void PutAndKill(TestDaemon& daemon) {
  PutPattern(daemon.socket(), "kept", 1 << 16);
  daemon.KillOnPurpose(SIGKILL);
  ASSERT_OK(daemon.process().Wait(absl::Seconds(30)));
  std::filesystem::remove(daemon.socket());
}

// The command line of a daemon that takes `killed`'s socket and prefix (and so its segments),
// with `extra` flags.
std::vector<std::string> Restart(const TestDaemon& killed, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {TensorShmdPath(), "--socket",          killed.socket(),
                                   "--shm-prefix",   killed.shm_prefix(), "--log-level",
                                   "warning",        "--host-pool",       "64Mi"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

// A daemon killed with --shm-group G comes back with G and serves its tensors again; without the
// option, or with another group, the restart refuses the segments (their group's members could
// have written them), names the fix, and changes nothing.
TEST(ShmGroupRecoveryTest, AGroupsSegmentsAreTakenBackOnlyWithThatGroup) {
  std::string why;
  if (!CanRunAsOtherUids(&why)) GTEST_SKIP() << why;
  const std::string group = std::to_string(kGroup);
  absl::StatusOr<TestDaemon> first =
      TestDaemon::Start("group-recover", {"--shm-group", group, "--host-pool", "64Mi"});
  ASSERT_OK(first);
  ASSERT_NO_FATAL_FAILURE(PutAndKill(*first));
  const std::string prefix = first->shm_prefix();
  const std::string segment = absl::StrCat("/dev/shm/", prefix, ".cpu.1");

  Exit without = RunProcess(Restart(*first, {}), first->dir() + "/without.log");
  std::cout << "refused: " << without.output;
  EXPECT_EQ(without.code, 1) << without.output;
  const std::string name = GroupName(kGroup);
  ExpectAll(without.output,
            {"recovering /" + prefix, segment, absl::StrCat("owned by uid ", geteuid()),
             "mode 0660", absl::StrCat("group ", name, " (gid ", kGroup, ")"),
             "a tensorshmd without --shm-group does not take it back",
             "restart with --shm-group " + name, "rm " + segment});
  EXPECT_EQ(ExpectGroupSegments(prefix, geteuid(), kGroup), 1) << "the refusal changed a segment";

  Exit other = RunProcess(Restart(*first, {"--shm-group", std::to_string(kOtherGroup)}),
                          first->dir() + "/other.log");
  std::cout << "refused: " << other.output;
  EXPECT_EQ(other.code, 1) << other.output;
  ExpectAll(other.output, {segment, "a tensorshmd with --shm-group " + GroupName(kOtherGroup),
                           "restart with --shm-group " + name});
  EXPECT_EQ(ExpectGroupSegments(prefix, geteuid(), kGroup), 1) << "the refusal changed a segment";

  std::filesystem::remove(first->socket());
  absl::StatusOr<ChildProcess> again =
      ChildProcess::Start(Restart(*first, {"--shm-group", group}), first->dir() + "/again.log");
  ASSERT_OK(again);
  ASSERT_TRUE(again->WaitForOutput("serving on", absl::Seconds(20))) << again->Output();
  ExpectBytes(first->socket(), "kept", 1 << 16);
  EXPECT_EQ(ExpectGroupSegments(prefix, geteuid(), kGroup), 1);
  ExpectCleanStop(*again);
  EXPECT_EQ(first->ShmObjectCount(), 0);
}

// The segments of a daemon killed without the option (0600) join the group when it restarts with
// --shm-group: recovery takes them back under the current setting.
TEST(ShmGroupRecoveryTest, PrivateSegmentsJoinTheGroupOnARestartWithIt) {
  std::string why;
  if (!CanRunAsOtherUids(&why)) GTEST_SKIP() << why;
  absl::StatusOr<TestDaemon> first = TestDaemon::Start("group-adopt", {"--host-pool", "64Mi"});
  ASSERT_OK(first);
  ASSERT_NO_FATAL_FAILURE(PutAndKill(*first));
  const std::string prefix = first->shm_prefix();
  for (const auto& [name, st] : ShmObjects(prefix)) EXPECT_EQ(st.st_mode & 07777, 0600u) << name;

  absl::StatusOr<ChildProcess> again = ChildProcess::Start(
      Restart(*first, {"--shm-group", std::to_string(kGroup)}), first->dir() + "/again.log");
  ASSERT_OK(again);
  ASSERT_TRUE(again->WaitForOutput("serving on", absl::Seconds(20))) << again->Output();
  EXPECT_EQ(ExpectGroupSegments(prefix, geteuid(), kGroup), 1);
  ExpectBytes(first->socket(), "kept", 1 << 16);
  ExpectCleanStop(*again);
}

}  // namespace
}  // namespace tensorshm::testing
