// tensorshmctl health: exit 0 only when the daemon answers the standard gRPC health check
// SERVING; 1 with a one-line reason when the socket is missing, nobody answers, it answers
// NOT_SERVING, its server is not trusted, or --timeout passes. It opens no tensorshm session.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"
#include "tests/support/ctl_run.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

#define ASSERT_OK(x) ASSERT_TRUE((x).ok()) << (x).status()

constexpr int kNobody = 65534;

// A scratch directory of this test's own, removed when it goes out of scope.
class Scratch {
 public:
  explicit Scratch(const std::string& name)
      : dir_(absl::StrCat(std::filesystem::temp_directory_path().string(), "/tsmtest-ctl-health-",
                          name, "-", getpid())) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~Scratch() { std::filesystem::remove_all(dir_); }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

// A Unix socket at `path` that listens and never accepts: the kernel completes connections
// (backlog), nobody speaks. The credentials the kernel reports for it are those of the process
// at listen(): with `as_uid`, a child process that dropped to that uid first.
class SilentListener {
 public:
  explicit SilentListener(const std::string& path, int as_uid = -1) {
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    if (as_uid < 0) {
      EXPECT_EQ(listen(fd_, 16), 0);
      return;
    }
    // The child only makes async-signal-safe calls before it pauses.
    child_ = fork();
    if (child_ == 0) {
      if (setgid(as_uid) != 0 || setuid(as_uid) != 0 || listen(fd_, 16) != 0) _exit(1);
      pause();
      _exit(0);
    }
  }
  ~SilentListener() {
    if (child_ > 0) {
      kill(child_, SIGKILL);
      waitpid(child_, nullptr, 0);
    }
    close(fd_);
  }
  // Waits until the child listens (a connect no longer fails with ECONNREFUSED).
  bool WaitListening(const std::string& path) {
    for (int attempt = 0; attempt < 2000; ++attempt) {
      const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un address{};
      address.sun_family = AF_UNIX;
      std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
      const bool connected =
          connect(probe, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
      close(probe);
      if (connected) return true;
      usleep(5000);
    }
    return false;
  }

 private:
  int fd_ = -1;
  pid_t child_ = -1;
};

TEST(CtlHealthTest, ServingDaemonExitsZeroInTextAndJson) {
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start("ctl-health-serving");
  ASSERT_OK(daemon);
  CtlRun text = RunCtl(daemon->dir(), {"health"}, {"TENSORSHM_SOCKET=" + daemon->socket()});
  EXPECT_EQ(text.exit_code, 0) << text.err;
  EXPECT_EQ(text.out, "SERVING\n");
  EXPECT_EQ(text.err, "");
  CtlRun json = RunCtl(daemon->dir(), {"--socket", daemon->socket(), "health", "-o", "json"});
  EXPECT_EQ(json.exit_code, 0) << json.err;
  EXPECT_EQ(json.Json()["serving"], true);
  EXPECT_EQ(json.Json()["socket"], daemon->socket());
  EXPECT_EQ(json.Json()["reason"], "");
}

// A probe every few seconds must not open and close a session each time: health talks to the
// health service alone. The daemon logs every session it opens (at info).
TEST(CtlHealthTest, HealthOpensNoSession) {
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("ctl-health-nosession", {"--log-level", "info"});
  ASSERT_OK(daemon);
  for (int i = 0; i < 3; ++i) {
    CtlRun run = RunCtl(daemon->dir(), {"--socket", daemon->socket(), "health"});
    ASSERT_EQ(run.exit_code, 0) << run.err;
  }
  CtlRun status = RunCtl(daemon->dir(), {"--socket", daemon->socket(), "status"});
  ASSERT_EQ(status.exit_code, 0) << status.err;
  // The session of `status` is logged (so the log does show sessions), and it is the only one.
  ASSERT_TRUE(daemon->process().WaitForOutput("client \"tensorshmctl\"", absl::Seconds(20)))
      << daemon->process().Output();
  const std::string log = daemon->process().Output();
  size_t sessions = 0;
  for (size_t at = log.find(" opened: pid"); at != std::string::npos;
       at = log.find(" opened: pid", at + 1)) {
    ++sessions;
  }
  EXPECT_EQ(sessions, 1u) << log;
}

TEST(CtlHealthTest, StoppedDaemonMissingSocketAndWrongPathExitOne) {
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start("ctl-health-stopped");
  ASSERT_OK(daemon);
  const std::string socket = daemon->socket();
  // Killed: its socket file stays, nobody listens on it.
  daemon->KillOnPurpose(SIGKILL);
  ASSERT_TRUE(daemon->process().Wait(absl::Seconds(30)).ok());
  CtlRun killed = RunCtl(daemon->dir(), {"--socket", socket, "health"});
  EXPECT_EQ(killed.exit_code, 1);
  EXPECT_EQ(killed.out, "");
  EXPECT_TRUE(absl::StartsWith(killed.err, "tensorshmctl: health: UNAVAILABLE: ")) << killed.err;
  EXPECT_TRUE(absl::StrContains(killed.err, "Connection refused")) << killed.err;
  EXPECT_EQ(std::count(killed.err.begin(), killed.err.end(), '\n'), 1) << killed.err;
  std::cout << killed.err;
  CtlRun json = RunCtl(daemon->dir(), {"--socket", socket, "health", "-o", "json"});
  EXPECT_EQ(json.exit_code, 1);
  EXPECT_EQ(json.Json()["serving"], false);
  EXPECT_TRUE(absl::StrContains(json.Json()["reason"].get<std::string>(), "Connection refused"));

  CtlRun wrong = RunCtl(daemon->dir(), {"--socket", daemon->dir() + "/wrong.sock", "health"});
  EXPECT_EQ(wrong.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(wrong.err, "wrong.sock")) << wrong.err;
  EXPECT_TRUE(absl::StrContains(wrong.err, "No such file or directory")) << wrong.err;
  std::cout << wrong.err;
}

TEST(CtlHealthTest, DaemonStoppedWithSigtermExitsOne) {
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start("ctl-health-sigterm");
  ASSERT_OK(daemon);
  daemon->process().Kill(SIGTERM);
  ASSERT_TRUE(daemon->process().Wait(absl::Seconds(30)).ok());
  CtlRun run = RunCtl(daemon->dir(), {"--socket", daemon->socket(), "health"});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(absl::StartsWith(run.err, "tensorshmctl: health: UNAVAILABLE: ")) << run.err;
  std::cout << run.err;
}

TEST(CtlHealthTest, SocketNobodyAnswersTimesOut) {
  Scratch scratch("silent");
  const std::string& dir = scratch.dir();
  const std::string path = dir + "/silent.sock";
  SilentListener listener(path);
  CtlRun run = RunCtl(dir, {"--socket", path, "--timeout", "300ms", "health"});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(absl::StartsWith(run.err, "tensorshmctl: health: DEADLINE_EXCEEDED: no answer"))
      << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "300ms")) << run.err;
  std::cout << run.err;
  // The other commands give up too, past --timeout, instead of hanging.
  CtlRun ls = RunCtl(dir, {"--socket", path, "--timeout", "300ms", "ls"});
  EXPECT_EQ(ls.exit_code, 1);
  EXPECT_TRUE(absl::StartsWith(ls.err, "tensorshmctl: ls: ")) << ls.err;
  std::cout << ls.err;
}

TEST(CtlHealthTest, NotServingExitsOne) {
  Scratch scratch("notserving");
  const std::string& dir = scratch.dir();
  const std::string path = dir + "/health.sock";
  // A gRPC server of the TensorShm service (every method unimplemented) whose health this test
  // sets: the daemon itself says NOT_SERVING only while it stops, too briefly to catch.
  grpc::EnableDefaultHealthCheckService(true);
  v1::TensorShm::CallbackService unimplemented;
  grpc::ServerBuilder builder;
  builder.RegisterService(&unimplemented);
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  server->GetHealthCheckService()->SetServingStatus(true);
  CtlRun serving = RunCtl(dir, {"--socket", path, "health"});
  EXPECT_EQ(serving.exit_code, 0) << serving.err;
  server->GetHealthCheckService()->SetServingStatus(false);
  CtlRun stopping = RunCtl(dir, {"--socket", path, "health"});
  EXPECT_EQ(stopping.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(stopping.err, "FAILED_PRECONDITION: ")) << stopping.err;
  EXPECT_TRUE(absl::StrContains(stopping.err, "answers NOT_SERVING")) << stopping.err;
  std::cout << stopping.err;
  server->Shutdown();
}

// The same server check as the client library's: a socket served by another uid is refused
// unless --server-uid names it.
TEST(CtlHealthTest, SocketServedByAnotherUidIsRefusedUnlessServerUidNamesIt) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to serve a socket as uid 65534";
  Scratch scratch("untrusted");
  const std::string& dir = scratch.dir();
  const std::string path = dir + "/other.sock";
  SilentListener listener(path, kNobody);
  ASSERT_TRUE(listener.WaitListening(path));
  CtlRun refused = RunCtl(dir, {"--socket", path, "--timeout", "300ms", "health"});
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_TRUE(absl::StartsWith(refused.err, "tensorshmctl: health: PERMISSION_DENIED: "))
      << refused.err;
  EXPECT_TRUE(absl::StrContains(refused.err, "served by uid 65534")) << refused.err;
  std::cout << refused.err;
  // Trusted: the check passes, and then nobody answers.
  CtlRun trusted =
      RunCtl(dir, {"--socket", path, "--timeout", "300ms", "--server-uid", "65534", "health"});
  EXPECT_EQ(trusted.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(trusted.err, "DEADLINE_EXCEEDED")) << trusted.err;
}

}  // namespace
}  // namespace tensorshm::testing
