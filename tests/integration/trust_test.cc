// What neither side takes on trust (issue 11): the daemon refuses a socket directory or a shared
// memory object another user could control, and a client refuses a socket served by a uid it
// does not expect. Real daemons (some run as uid 65534 with setpriv), real clients.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/daemon_connection.h"
#include "client/memory_channel.h"
#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tensorshm/tensorshm.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

#define ASSERT_OK(x) ASSERT_TRUE((x).ok()) << (x).status()

constexpr uid_t kNobody = 65534;

// A fresh directory of this test under /tmp (removed with everything in it when it goes), and
// an shm prefix of its own whose objects are removed before and after.
class Scratch {
 public:
  explicit Scratch(const std::string& tag)
      : dir_(absl::StrCat("/tmp/tsm-trust-", tag, "-", getpid())),
        prefix_(absl::StrCat("tsmtrust-", tag, "-", getpid())) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directory(dir_);
    chmod(dir_.c_str(), 0755);
    RemoveShm();
  }
  ~Scratch() {
    std::filesystem::remove_all(dir_);
    RemoveShm();
  }
  const std::string& dir() const { return dir_; }
  const std::string& prefix() const { return prefix_; }
  std::string ShmPath(const std::string& suffix) const {
    return absl::StrCat("/dev/shm/", prefix_, ".", suffix);
  }

 private:
  void RemoveShm() const {
    DIR* shm = opendir("/dev/shm");
    if (shm == nullptr) return;
    while (dirent* entry = readdir(shm)) {
      if (absl::StartsWith(entry->d_name, prefix_ + ".")) {
        unlink(absl::StrCat("/dev/shm/", entry->d_name).c_str());
      }
    }
    closedir(shm);
  }
  std::string dir_;
  std::string prefix_;
};

std::vector<std::string> DaemonArgs(const std::string& socket, const std::string& prefix) {
  return {TensorShmdPath(), "--socket",       socket, "--shm-prefix", prefix,   "--host-pool",
          "64Mi",           "--segment-size", "16Mi", "--log-level",  "warning"};
}

// Runs a tensorshmd that is expected to refuse to start; returns its wait status and output.
std::pair<int, std::string> RunRefusedDaemon(const std::vector<std::string>& argv,
                                             const std::string& log) {
  absl::StatusOr<ChildProcess> daemon = ChildProcess::Start(argv, log);
  if (!daemon.ok()) return {-1, std::string(daemon.status().message())};
  absl::StatusOr<int> status = daemon->Wait(absl::Seconds(20));
  return {status.ok() ? *status : -1, daemon->Output()};
}

bool ExitedNonZero(int status) { return WIFEXITED(status) && WEXITSTATUS(status) != 0; }

void ExpectAll(const std::string& text, const std::vector<std::string>& parts) {
  for (const std::string& part : parts) {
    EXPECT_TRUE(absl::StrContains(text, part)) << "missing \"" << part << "\" in: " << text;
  }
}

// ---- The socket's directory ----

TEST(SocketDirectoryTest, SquattedByAnotherUidIsRefusedNamingOwnerModeAndFix) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to make a directory owned by uid 65534";
  Scratch scratch("squat");
  const std::string squatted = scratch.dir() + "/run";
  ASSERT_EQ(mkdir(squatted.c_str(), 0700), 0);
  ASSERT_EQ(chown(squatted.c_str(), kNobody, kNobody), 0);
  auto [status, output] = RunRefusedDaemon(
      DaemonArgs(squatted + "/tensorshm.sock", scratch.prefix()), scratch.dir() + "/daemon.log");
  std::cout << "refused: " << output;
  EXPECT_TRUE(ExitedNonZero(status)) << output;
  ExpectAll(output, {"--socket = \"" + squatted + "/tensorshm.sock\"", squatted,
                     "owned by uid 65534", "mode 0700", "not by tensorshmd's uid 0",
                     "Remove " + squatted, "choose another --socket"});
  struct stat st;
  EXPECT_NE(lstat((squatted + "/tensorshm.sock").c_str(), &st), 0);  // nothing was bound there
}

TEST(SocketDirectoryTest, OwnDirectoryWritableByOthersIsRefused) {
  Scratch scratch("mode");
  const std::string open_dir = scratch.dir() + "/run";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0777), 0);
  auto [status, output] = RunRefusedDaemon(
      DaemonArgs(open_dir + "/tensorshm.sock", scratch.prefix()), scratch.dir() + "/daemon.log");
  std::cout << "refused: " << output;
  EXPECT_TRUE(ExitedNonZero(status)) << output;
  ExpectAll(output, {open_dir, absl::StrCat("owned by uid ", geteuid()), "mode 0777",
                     "writable by group or others", "chmod go-w " + open_dir});
}

TEST(SocketDirectoryTest, SymbolicLinkInThePathIsRefusedNotFollowed) {
  Scratch scratch("link");
  const std::string target = scratch.dir() + "/elsewhere";
  const std::string link = scratch.dir() + "/run";
  ASSERT_EQ(mkdir(target.c_str(), 0700), 0);
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  auto [status, output] = RunRefusedDaemon(DaemonArgs(link + "/tensorshm.sock", scratch.prefix()),
                                           scratch.dir() + "/daemon.log");
  std::cout << "refused: " << output;
  EXPECT_TRUE(ExitedNonZero(status)) << output;
  ExpectAll(output, {link + " is a symbolic link", "(to " + target, "follows no link"});
  struct stat st;
  EXPECT_NE(lstat((target + "/tensorshm.sock").c_str(), &st), 0);  // not followed

  // A link as the socket file itself is refused too.
  ASSERT_EQ(symlink((target + "/x").c_str(), (target + "/tensorshm.sock").c_str()), 0);
  auto [file_status, file_output] = RunRefusedDaemon(
      DaemonArgs(target + "/tensorshm.sock", scratch.prefix()), scratch.dir() + "/daemon2.log");
  EXPECT_TRUE(ExitedNonZero(file_status)) << file_output;
  ExpectAll(file_output, {target + "/tensorshm.sock is a symbolic link"});
}

TEST(SocketDirectoryTest, DirectoryAboveWritableByOthersIsRefused) {
  Scratch scratch("above");
  const std::string above = scratch.dir() + "/open";
  ASSERT_EQ(mkdir(above.c_str(), 0700), 0);
  ASSERT_EQ(chmod(above.c_str(), 0777), 0);
  auto [status, output] = RunRefusedDaemon(
      DaemonArgs(above + "/run/tensorshm.sock", scratch.prefix()), scratch.dir() + "/daemon.log");
  EXPECT_TRUE(ExitedNonZero(status)) << output;
  ExpectAll(output, {above + " (a directory above the socket's)", "mode 0777", "chmod go-w"});
}

// What the daemon makes itself is private (0700), or traversable (0711) when shared; a
// root-owned sticky directory (/tmp) may hold the socket directly.
TEST(SocketDirectoryTest, DirectoriesItMakesAreItsOwnAndStickyTmpMayHoldTheSocket) {
  Scratch scratch("made");
  struct stat st;
  {
    const std::string socket = scratch.dir() + "/a/b/tensorshm.sock";
    absl::StatusOr<ChildProcess> daemon =
        ChildProcess::Start(DaemonArgs(socket, scratch.prefix()), scratch.dir() + "/made.log");
    ASSERT_OK(daemon);
    ASSERT_TRUE(daemon->WaitForOutput("serving on", absl::Seconds(20))) << daemon->Output();
    ASSERT_EQ(stat((scratch.dir() + "/a/b").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u);
    EXPECT_EQ(st.st_uid, geteuid());
    daemon->Kill(SIGTERM);
    ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
  }
  {
    std::vector<std::string> argv =
        DaemonArgs(scratch.dir() + "/c/tensorshm.sock", scratch.prefix());
    argv.insert(argv.end(), {"--allow-uid", std::to_string(kNobody)});
    absl::StatusOr<ChildProcess> daemon = ChildProcess::Start(argv, scratch.dir() + "/shared.log");
    ASSERT_OK(daemon);
    ASSERT_TRUE(daemon->WaitForOutput("serving on", absl::Seconds(20))) << daemon->Output();
    ASSERT_EQ(stat((scratch.dir() + "/c").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0711u);
    daemon->Kill(SIGTERM);
    ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
  }
  ASSERT_EQ(stat("/tmp", &st), 0);
  if (st.st_uid != 0 || (st.st_mode & S_ISVTX) == 0) GTEST_SKIP() << "/tmp is not root's sticky";
  const std::string in_tmp = absl::StrCat("/tmp/tsm-trust-", getpid(), ".sock");
  absl::StatusOr<ChildProcess> daemon =
      ChildProcess::Start(DaemonArgs(in_tmp, scratch.prefix()), scratch.dir() + "/tmp.log");
  ASSERT_OK(daemon);
  ASSERT_TRUE(daemon->WaitForOutput("serving on", absl::Seconds(20))) << daemon->Output();
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{in_tmp, "tmp"});
  ASSERT_OK(client);
  EXPECT_TRUE((*client)->Stat().ok());
  client->reset();
  daemon->Kill(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
}

// ---- Shared memory a restarted daemon would take back ----

// Plants /dev/shm/<prefix>.ctl: `bytes` bytes, owner `uid`, mode `mode`.
void PlantControlObject(const std::string& path, uid_t uid, mode_t mode) {
  const int fd = open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  ASSERT_EQ(ftruncate(fd, 1 << 20), 0);
  ASSERT_EQ(fchown(fd, uid, uid), 0);
  ASSERT_EQ(fchmod(fd, mode), 0);
  close(fd);
}

TEST(PlantedShmTest, ControlObjectOfAnotherUidIsRefusedAndLeftInPlace) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to make an object owned by uid 65534";
  Scratch scratch("planted");
  const std::string control = scratch.ShmPath("ctl");
  PlantControlObject(control, kNobody, 0600);
  auto [status, output] = RunRefusedDaemon(DaemonArgs(scratch.dir() + "/s.sock", scratch.prefix()),
                                           scratch.dir() + "/daemon.log");
  std::cout << "refused: " << output;
  EXPECT_TRUE(ExitedNonZero(status)) << output;
  ExpectAll(output, {control, "owned by uid 65534", "mode 0600", "not one of its own",
                     "rm " + control, "--shm-prefix"});
  struct stat st;
  ASSERT_EQ(lstat(control.c_str(), &st), 0) << "the planted object was removed";
  EXPECT_EQ(st.st_uid, kNobody);
  EXPECT_EQ(st.st_size, 1 << 20);
}

TEST(PlantedShmTest, ControlObjectOfTheWrongModeOrALinkIsRefusedAndLeftInPlace) {
  Scratch scratch("mode0666");
  const std::string control = scratch.ShmPath("ctl");
  PlantControlObject(control, geteuid(), 0666);
  auto [status, output] = RunRefusedDaemon(DaemonArgs(scratch.dir() + "/s.sock", scratch.prefix()),
                                           scratch.dir() + "/daemon.log");
  std::cout << "refused: " << output;
  EXPECT_TRUE(ExitedNonZero(status)) << output;
  ExpectAll(output, {control, absl::StrCat("owned by uid ", geteuid()), "mode 0666",
                     "with mode 0600", "--shm-prefix"});
  struct stat st;
  ASSERT_EQ(lstat(control.c_str(), &st), 0) << "the planted object was removed";
  EXPECT_EQ(st.st_mode & 07777, 0666u);

  // A link under the control segment's name is not followed to whatever it names.
  ASSERT_EQ(unlink(control.c_str()), 0);
  const std::string target = scratch.dir() + "/target";
  PlantControlObject(target, geteuid(), 0600);
  ASSERT_EQ(symlink(target.c_str(), control.c_str()), 0);
  auto [link_status, link_output] = RunRefusedDaemon(
      DaemonArgs(scratch.dir() + "/s.sock", scratch.prefix()), scratch.dir() + "/daemon2.log");
  EXPECT_TRUE(ExitedNonZero(link_status)) << link_output;
  ExpectAll(link_output, {control + ": a symbolic link"});
  EXPECT_EQ(lstat(control.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
}

// A data segment swapped behind a kept control segment: the recovery refuses it by name and
// leaves every object where it was (its own too), for the operator to look at.
TEST(PlantedShmTest, SwappedDataSegmentIsRefusedAndNothingIsRemoved) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to make an object owned by uid 65534";
  Scratch scratch("swapped");
  const std::string socket = scratch.dir() + "/s.sock";
  std::vector<std::string> argv = DaemonArgs(socket, scratch.prefix());
  argv.push_back("--keep-segments");
  absl::StatusOr<ChildProcess> daemon = ChildProcess::Start(argv, scratch.dir() + "/first.log");
  ASSERT_OK(daemon);
  ASSERT_TRUE(daemon->WaitForOutput("serving on", absl::Seconds(20))) << daemon->Output();
  daemon->Kill(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
  const std::string segment = scratch.ShmPath("cpu.1");
  struct stat st;
  ASSERT_EQ(stat(segment.c_str(), &st), 0) << "--keep-segments kept no segment";
  ASSERT_EQ(chown(segment.c_str(), kNobody, kNobody), 0);

  auto [status, output] =
      RunRefusedDaemon(DaemonArgs(socket, scratch.prefix()), scratch.dir() + "/second.log");
  std::cout << "refused: " << output;
  EXPECT_TRUE(ExitedNonZero(status)) << output;
  ExpectAll(output, {"recovering /" + scratch.prefix(), segment, "owned by uid 65534"});
  ASSERT_EQ(stat(segment.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, kNobody);
  EXPECT_EQ(stat(scratch.ShmPath("ctl").c_str(), &st), 0) << "the control segment was removed";
}

// ---- Who serves the socket ----

// A tensorshmd run as uid 65534 (setpriv) that admits root, its socket in a directory that uid
// owns.
class NobodyDaemon {
 public:
  static absl::StatusOr<NobodyDaemon> Start(const Scratch& scratch, const std::string& run_dir,
                                            const std::string& log) {
    NobodyDaemon daemon;
    daemon.socket_ = run_dir + "/tensorshm.sock";
    std::vector<std::string> argv = {"/usr/bin/setpriv", "--reuid", "65534",
                                     "--regid",          "65534",   "--clear-groups"};
    for (const std::string& arg : DaemonArgs(daemon.socket_, scratch.prefix() + "-nobody")) {
      argv.push_back(arg);
    }
    // It admits root, this test's uid: what is under test is whether root's client trusts it.
    argv.insert(argv.end(), {"--allow-uid", "0"});
    absl::StatusOr<ChildProcess> process = ChildProcess::Start(argv, log);
    if (!process.ok()) return process.status();
    daemon.process_ = std::make_unique<ChildProcess>(*std::move(process));
    if (!daemon.process_->WaitForOutput("serving on", absl::Seconds(20))) {
      return absl::UnavailableError("tensorshmd as uid 65534 did not start: " +
                                    daemon.process_->Output());
    }
    return daemon;
  }
  NobodyDaemon(NobodyDaemon&&) = default;
  ~NobodyDaemon() { Stop(); }
  void Stop() {
    if (process_ == nullptr) return;
    process_->Kill(SIGTERM);
    if (!process_->Wait(absl::Seconds(20)).ok()) process_->Kill(SIGKILL);
    process_.reset();
  }
  const std::string& socket() const { return socket_; }
  pid_t pid() const { return process_->pid(); }

 private:
  NobodyDaemon() = default;
  std::string socket_;
  std::unique_ptr<ChildProcess> process_;
};

bool CanRunAsNobody(std::string* why) {
  if (geteuid() != 0) {
    *why = "needs root to start a daemon as uid 65534";
    return false;
  }
  if (access("/usr/bin/setpriv", X_OK) != 0) {
    *why = "needs /usr/bin/setpriv";
    return false;
  }
  return true;
}

// A directory uid 65534 owns, for its daemon's socket.
std::string NobodyRunDir(const Scratch& scratch) {
  const std::string dir = scratch.dir() + "/nobody";
  mkdir(dir.c_str(), 0700);
  chown(dir.c_str(), kNobody, kNobody);
  return dir;
}

TEST(ServerUidTest, ClientRefusesAnotherUidsDaemonUnlessNamed) {
  std::string why;
  if (!CanRunAsNobody(&why)) GTEST_SKIP() << why;
  Scratch scratch("serveruid");
  absl::StatusOr<NobodyDaemon> daemon =
      NobodyDaemon::Start(scratch, NobodyRunDir(scratch), scratch.dir() + "/daemon.log");
  ASSERT_OK(daemon);

  tensorshm::StatusOr<std::shared_ptr<Client>> refused =
      Client::Connect(ClientOptions{daemon->socket(), "root-default"});
  ASSERT_EQ(refused.status().code(), tensorshm::StatusCode::kPermissionDenied) << refused.status();
  std::cout << "refused: " << refused.status().message() << "\n";
  ExpectAll(std::string(refused.status().message()),
            {"unix:" + daemon->socket(), "served by uid 65534",
             absl::StrCat("(pid ", daemon->pid(), ")"), "expects uid 0", "server_uid = 65534"});

  // The C API refuses the same way, and takes the uid too.
  tsm_client* c_client = nullptr;
  EXPECT_EQ(tsm_connect(daemon->socket().c_str(), "c", &c_client), TSM_PERMISSION_DENIED);
  EXPECT_EQ(c_client, nullptr);
  EXPECT_TRUE(absl::StrContains(tsm_last_error(), "served by uid 65534")) << tsm_last_error();
  ASSERT_EQ(tsm_connect_server_uid(daemon->socket().c_str(), "c", kNobody, &c_client), TSM_OK)
      << tsm_last_error();
  tsm_stats stats{};
  EXPECT_EQ(tsm_stat(c_client, &stats), TSM_OK) << tsm_last_error();
  tsm_client_free(c_client);
  EXPECT_EQ(tsm_connect_server_uid(daemon->socket().c_str(), "c", -2, &c_client),
            TSM_INVALID_ARGUMENT);

  // The memory channel checks its own connection as well.
  MemoryChannel channel(daemon->socket(), std::nullopt);
  v1::ChannelRequest request;
  int fd = -1;
  absl::StatusOr<v1::ChannelResponse> exchanged = channel.Exchange("token", request, &fd);
  EXPECT_EQ(exchanged.status().code(), absl::StatusCode::kPermissionDenied) << exchanged.status();
  EXPECT_TRUE(absl::StartsWith(exchanged.status().message(), "memory channel: tensorshmd at"))
      << exchanged.status();

  // Named, the daemon is used: tensors go through it as through any other.
  ClientOptions options{daemon->socket(), "root-named"};
  options.server_uid = kNobody;
  tensorshm::StatusOr<std::shared_ptr<Client>> client = Client::Connect(options);
  ASSERT_OK(client);
  tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLInt, 32, 1}, {1024}});
  ASSERT_OK(w);
  for (int i = 0; i < 1024; ++i) static_cast<int32_t*>(w->data())[i] = 7 * i;
  ASSERT_TRUE((*client)->Publish(*w, "named").ok());
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire("named");
  ASSERT_OK(t);
  const auto* data = static_cast<const int32_t*>((*t)->dl_tensor.data);
  EXPECT_EQ(data[0], 0);
  EXPECT_EQ(data[1023], 7 * 1023);
  (*t)->deleter(*t);
  EXPECT_TRUE((*client)->Flush().ok());
}

// The check is made on every connection, so a client reconnecting after its daemon went away
// refuses whoever serves the path now, and takes up with a trusted daemon again when one does.
TEST(ServerUidTest, ReconnectChecksWhoServesTheSocketNow) {
  std::string why;
  if (!CanRunAsNobody(&why)) GTEST_SKIP() << why;
  Scratch scratch("reconnect");
  const std::string run = scratch.dir() + "/run";
  ASSERT_EQ(mkdir(run.c_str(), 0755), 0);
  const std::string socket = run + "/tensorshm.sock";
  auto start_root = [&](const std::string& log) {
    absl::StatusOr<ChildProcess> daemon =
        ChildProcess::Start(DaemonArgs(socket, scratch.prefix()), scratch.dir() + "/" + log);
    TSM_CHECK(daemon.ok());
    TSM_CHECK(daemon->WaitForOutput("serving on", absl::Seconds(20)));
    return std::make_unique<ChildProcess>(*std::move(daemon));
  };
  std::unique_ptr<ChildProcess> trusted = start_root("first.log");
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{socket, "reconnecting"});
  ASSERT_OK(client);
  ASSERT_TRUE((*client)->Stat().ok());

  // The trusted daemon goes; uid 65534 takes the path over.
  trusted->Kill(SIGTERM);
  ASSERT_TRUE(trusted->Wait(absl::Seconds(20)).ok());
  ASSERT_EQ(chown(run.c_str(), kNobody, kNobody), 0);
  absl::StatusOr<NobodyDaemon> squatter =
      NobodyDaemon::Start(scratch, run, scratch.dir() + "/squatter.log");
  ASSERT_OK(squatter);
  tensorshm::Status flushed;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  do {
    flushed = (*client)->Flush();
    if (absl::StrContains(flushed.message(), "served by uid 65534")) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  std::cout << "while uid 65534 serves: " << flushed << "\n";
  EXPECT_EQ(flushed.code(), absl::StatusCode::kUnavailable) << flushed;
  EXPECT_TRUE(absl::StrContains(flushed.message(), "served by uid 65534")) << flushed;
  // A call does not wait out its deadline for a session the squatter would have to grant: it is
  // told at the next refused attempt (UNAVAILABLE after 60 s, before).
  tensorshm::StatusOr<ServerStats> refused = (*client)->Stat();
  std::cout << "Stat while uid 65534 serves: " << refused.status() << "\n";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "a new one was refused"))
      << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "served by uid 65534"))
      << refused.status();
  // The refused client never opened a session there: the squatter's only session is this one.
  ClientOptions look{socket, "look"};
  look.server_uid = kNobody;
  tensorshm::StatusOr<std::shared_ptr<Client>> looker = Client::Connect(look);
  ASSERT_OK(looker);
  tensorshm::StatusOr<ServerStats> squatter_stats = (*looker)->Stat();
  ASSERT_OK(squatter_stats);
  EXPECT_EQ(squatter_stats->sessions, 1);
  looker->reset();
  squatter->Stop();

  // A trusted daemon again: the client reconnects on its own.
  ASSERT_EQ(chown(run.c_str(), 0, 0), 0);
  trusted = start_root("second.log");
  bool back = false;
  const absl::Time back_deadline = absl::Now() + absl::Seconds(20);
  while (!back && absl::Now() < back_deadline) {
    back = (*client)->Flush().ok() && (*client)->Stat().ok();
    if (!back) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(back) << (*client)->Flush();
  client->reset();
  trusted->Kill(SIGTERM);
  ASSERT_TRUE(trusted->Wait(absl::Seconds(20)).ok());
}

}  // namespace
}  // namespace tensorshm::testing
