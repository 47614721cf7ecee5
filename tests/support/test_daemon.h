// Starts a real tensorshmd for a test: its own socket, shm prefix and temporary directory.
#ifndef TENSORSHM_TESTS_SUPPORT_TEST_DAEMON_H_
#define TENSORSHM_TESTS_SUPPORT_TEST_DAEMON_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/support/status_codes.h"

namespace tensorshm::testing {

// A child process started with posix_spawn, stdout captured to a file.
class ChildProcess {
 public:
  // Starts `argv[0]` with `argv`; its stdout and stderr go to `log_path`. `env` ("NAME=value")
  // is added to (or overrides) this process's environment.
  static absl::StatusOr<ChildProcess> Start(const std::vector<std::string>& argv,
                                            const std::string& log_path,
                                            const std::vector<std::string>& env = {});
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ~ChildProcess();  // SIGKILLs and reaps the child if it still runs

  pid_t pid() const { return pid_; }
  // Waits for exit; returns the raw wait status, or DEADLINE_EXCEEDED (child left running).
  absl::StatusOr<int> Wait(absl::Duration timeout);
  void Kill(int signal_number);
  // Everything the child has written so far.
  std::string Output() const;
  // Waits until the output contains `text`; false on timeout or child exit without it.
  bool WaitForOutput(const std::string& text, absl::Duration timeout);

 private:
  ChildProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}
  pid_t pid_ = -1;
  std::string log_path_;
  bool reaped_ = false;
  int status_ = 0;  // wait status, once reaped
};

// A tensorshmd for one test. Removes leftovers of an earlier run with the same prefix first.
class TestDaemon {
 public:
  // Starts the daemon with `extra_args` and waits until its socket accepts connections.
  static absl::StatusOr<TestDaemon> Start(const std::string& test_name,
                                          const std::vector<std::string>& extra_args = {},
                                          const std::vector<std::string>& env = {});
  TestDaemon(TestDaemon&& other) noexcept;
  // Ends this daemon as the destructor does (without removing its directory, which a daemon
  // restarted under the same name shares), then takes `other`'s.
  TestDaemon& operator=(TestDaemon&& other) noexcept;
  // SIGTERMs the daemon (unless it already exited) and fails the running test, printing the
  // daemon's log, unless the daemon exited 0 within 60 s, or if its log holds a sanitizer report
  // (AddressSanitizer, LeakSanitizer, ThreadSanitizer, UndefinedBehaviorSanitizer, "runtime
  // error:"). After KillOnPurpose any exit passes; the log is still checked. Then removes the
  // directory and the daemon's /dev/shm objects.
  ~TestDaemon();

  // Sends `signal_number` to the daemon, which the test kills on purpose: its exit status is not
  // checked at the end (its log still is). For SIGTERM, which must exit 0, use process().Kill.
  void KillOnPurpose(int signal_number);

  const std::string& socket() const { return socket_; }
  const std::string& shm_prefix() const { return shm_prefix_; }
  const std::string& dir() const { return dir_; }
  ChildProcess& process() { return *process_; }
  // Number of /dev/shm entries whose name starts with the prefix.
  int ShmObjectCount() const;

 private:
  TestDaemon() = default;
  // The destructor's check: stops the daemon and reports a bad exit or a sanitizer report.
  void Finish();
  std::string dir_;
  std::string socket_;
  std::string shm_prefix_;
  std::unique_ptr<ChildProcess> process_;
  bool killed_on_purpose_ = false;
};

// Why a daemon's `log` fails a test: the first line of a sanitizer report in it, or "" if none.
std::string SanitizerReport(const std::string& log);

// True in a sanitizer build (ASan, TSan): everything runs several times slower, and ASan keeps
// freed memory in quarantine (a process's RSS does not fall back).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
// True under ThreadSanitizer alone: it checks every race it sees inside the uninstrumented gRPC
// against tests/tsan.supp, slowly (a daemon tearing down thousands of cancelled calls at once
// was seen taking over a minute to exit, in TSan's report path).
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitized = true;
#else
inline constexpr bool kThreadSanitized = false;
#endif

// Starts a TestDaemon that admits `uids` too (--allow-uid each), its directory open to them so
// that they reach the socket.
absl::StatusOr<TestDaemon> StartAdmitting(const std::string& test_name,
                                          std::vector<std::string> extra_args,
                                          const std::vector<int>& uids);

// The words that run a command as `uid` (and its gid), without supplementary groups: prepend
// them to an argv.
std::vector<std::string> AsUid(int uid);

// Runs `argv` to its end (at most `limit`), its stdout going to `log_path`; returns its output,
// with "exit N" (or "exit timeout") appended unless it exited 0.
std::string RunToEnd(const std::vector<std::string>& argv, const std::string& log_path,
                     absl::Duration limit = absl::Seconds(120));

// Removes /dev/shm/<prefix>.* (what a daemon with --keep-segments, or a killed one, left).
void RemoveShmObjects(const std::string& prefix);

// The rest of the first line of `output` starting with `key` + " ", or "" if none.
std::string Line(const std::string& output, const std::string& key);

// Waits until every thread of process `pid` is stopped (SIGSTOP delivered: state T in
// /proc/PID/task/*/stat); kill() returns before that, and a thread still running may answer one
// more request. False if not within `timeout`.
bool WaitUntilStopped(pid_t pid, absl::Duration timeout);

// Waits until a thread of process `pid` sleeps in a shared (not process-private) FUTEX_WAIT, as
// the client's fast path does waiting for a publish (the daemon wakes it from its own mapping;
// gRPC's and the C++ runtime's waits are all private): read from /proc/PID/task/*/syscall.
// False if not within `timeout`.
bool WaitUntilSleepingOnSharedFutex(pid_t pid, absl::Duration timeout);

// Bytes this process has written into its Unix sockets that their peers have not read yet
// (SIOCOUTQ, summed over every socket in /proc/self/fd): grows when a request is sent to a
// stopped daemon.
int64_t UnreadSocketBytes();

// Connections waiting in the backlog of the Unix socket listening at `path` (a stopped daemon
// accepts none): `ss`'s Recv-Q of a listening socket. -1 if ss cannot tell.
int ListenBacklog(const std::string& path);

// What each thread of process `pid` is doing, for a failure message about a process that hangs:
// gdb's backtraces when gdb is installed, else each thread's wait channel and kernel stack.
std::string ThreadStacks(pid_t pid);

// Path of a built test tool (the peer program, the C consumer, tensorshmd).
std::string TensorShmdPath();
std::string PeerPath();
std::string CConsumerPath();
// The emulated CUDA driver library (tests/support/fake_cuda), for TENSORSHM_LIBCUDA.
std::string FakeCudaPath();
// Removes the emulated driver's pages (/dev/shm/tsmfakecu.<pid>.*: device memory and events) of
// processes that have ended: a producer killed at a test's end leaves its events' pages behind.
void RemoveDeadProcessesFakeCudaPages();

}  // namespace tensorshm::testing

#endif  // TENSORSHM_TESTS_SUPPORT_TEST_DAEMON_H_
