#include "tests/support/test_daemon.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <linux/sockios.h>
#include <signal.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/sys_error.h"
#include "gtest/gtest.h"

extern char** environ;

namespace tensorshm::testing {

std::string TensorShmdPath() {
  // $TENSORSHMD where set (a bundle's daemon), else the build's.
  const char* path = std::getenv("TENSORSHMD");
  return path != nullptr && *path != '\0' ? path : TENSORSHMD_PATH;
}
bool WaitUntilStopped(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  while (absl::Now() < deadline) {
    bool all = true;
    std::error_code error;
    for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      // "TID (comm) S ...": the state follows the last ')'.
      const size_t paren = line.rfind(')');
      const char state =
          paren != std::string::npos && paren + 2 < line.size() ? line[paren + 2] : '?';
      all = all && (state == 'T' || state == 't');
    }
    if (all && !error) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

bool WaitUntilSleepingOnSharedFutex(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  do {
    std::error_code error;
    for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
      // "NR ARG0 ARG1 ...", the arguments in hex; "running" or "-1 ..." when not in a call.
      std::ifstream syscall_file(task.path() / "syscall");
      long number = -1;
      std::string address;
      std::string op;
      if (!(syscall_file >> number >> address >> op) || number != SYS_futex) continue;
      const unsigned long value = std::strtoul(op.c_str(), nullptr, 16);
      if ((value & FUTEX_PRIVATE_FLAG) == 0 &&
          ((value & FUTEX_CMD_MASK) == FUTEX_WAIT || (value & FUTEX_CMD_MASK) == FUTEX_WAIT_BITSET))
        return true;
    }
    absl::SleepFor(absl::Milliseconds(1));
  } while (absl::Now() < deadline);
  return false;
}

int64_t UnreadSocketBytes() {
  int64_t total = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", error)) {
    const int fd = std::atoi(entry.path().filename().c_str());
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    int queued = 0;
    if (ioctl(fd, SIOCOUTQ, &queued) == 0) total += queued;
  }
  return total;
}

int ListenBacklog(const std::string& path) {
  const std::string command = absl::StrCat("ss -xlnH src '", path, "' 2>/dev/null");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return -1;
  char line[512] = {};
  const bool read = fgets(line, sizeof(line), pipe) != nullptr;
  pclose(pipe);
  // "u_str LISTEN <Recv-Q> <Send-Q> <path> ...".
  std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipWhitespace());
  int queued = -1;
  if (!read || fields.size() < 3 || !absl::SimpleAtoi(fields[2], &queued)) return -1;
  return queued;
}

std::string ThreadStacks(pid_t pid) {
  std::string stacks;
  if (access("/usr/bin/gdb", X_OK) == 0) {
    const std::string command =
        absl::StrCat("timeout 60 /usr/bin/gdb -p ", pid,
                     " -batch -nx -ex 'set pagination off' -ex 'thread apply all bt 30' 2>&1");
    if (FILE* gdb = popen(command.c_str(), "r")) {
      char buffer[4096];
      size_t got = 0;
      while ((got = fread(buffer, 1, sizeof(buffer), gdb)) > 0) stacks.append(buffer, got);
      pclose(gdb);
    }
    if (absl::StrContains(stacks, "Thread ")) return stacks;
  }
  std::error_code error;
  for (const auto& task :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), error)) {
    std::ifstream wchan(task.path() / "wchan");
    std::ifstream kernel(task.path() / "stack");
    std::stringstream text;
    text << "thread " << task.path().filename().string() << " waits in " << wchan.rdbuf() << "\n"
         << kernel.rdbuf();
    absl::StrAppend(&stacks, text.str(), "\n");
  }
  return stacks;
}

std::string Line(const std::string& output, const std::string& key) {
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (absl::StartsWith(line, key + " ")) return std::string(line.substr(key.size() + 1));
  }
  return "";
}

absl::StatusOr<TestDaemon> StartAdmitting(const std::string& test_name,
                                          std::vector<std::string> extra_args,
                                          const std::vector<int>& uids) {
  for (int uid : uids) extra_args.insert(extra_args.end(), {"--allow-uid", std::to_string(uid)});
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(test_name, extra_args);
  if (daemon.ok()) chmod(daemon->dir().c_str(), 0755);
  return daemon;
}

std::vector<std::string> AsUid(int uid) {
  return {"/usr/bin/setpriv", absl::StrCat("--reuid=", uid), absl::StrCat("--regid=", uid),
          "--clear-groups"};
}

std::string RunToEnd(const std::vector<std::string>& argv, const std::string& log_path,
                     absl::Duration limit) {
  absl::StatusOr<ChildProcess> child = ChildProcess::Start(argv, log_path);
  if (!child.ok()) return absl::StrCat("exit start: ", child.status().ToString());
  absl::StatusOr<int> status = child->Wait(limit);
  std::string output = child->Output();
  if (!status.ok() || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
    absl::StrAppend(&output, "exit ", status.ok() ? std::to_string(*status) : "timeout");
  }
  return output;
}

std::string PeerPath() { return TSM_PEER_PATH; }
std::string CConsumerPath() { return TSM_C_CONSUMER_PATH; }
std::string FakeCudaPath() { return TSM_FAKE_CUDA_PATH; }

void RemoveDeadProcessesFakeCudaPages() {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
    const std::string file = entry.path().filename().string();
    if (!absl::StartsWith(file, "tsmfakecu.")) continue;
    const pid_t pid = std::atoi(file.c_str() + strlen("tsmfakecu."));
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH)
      std::filesystem::remove(entry.path(), error);
  }
}

absl::StatusOr<ChildProcess> ChildProcess::Start(const std::vector<std::string>& argv,
                                                 const std::string& log_path,
                                                 const std::vector<std::string>& env) {
  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const std::string& extra : env) overridden |= extra.substr(0, extra.find('=')) == name;
    if (!overridden) environment.push_back(entry);
  }
  environment.insert(environment.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (const std::string& e : environment) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int err = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) return ErrnoError("posix_spawn", argv[0], err);
  return ChildProcess(pid, log_path);
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept { *this = std::move(other); }

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  std::swap(pid_, other.pid_);
  std::swap(log_path_, other.log_path_);
  std::swap(reaped_, other.reaped_);
  std::swap(status_, other.status_);
  return *this;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

void ChildProcess::Kill(int signal_number) {
  if (pid_ > 0 && !reaped_) kill(pid_, signal_number);
}

absl::StatusOr<int> ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (reaped_) return status_;
    const pid_t r = waitpid(pid_, &status_, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      return status_;
    }
    if (r < 0) return ErrnoError("waitpid", std::to_string(pid_), errno);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("pid ", pid_, " still running"));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

std::string ChildProcess::Output() const {
  std::ifstream in(log_path_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool ChildProcess::WaitForOutput(const std::string& text, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (absl::StrContains(Output(), text)) return true;
    if (!reaped_ && waitpid(pid_, &status_, WNOHANG) == pid_) {
      reaped_ = true;
      return absl::StrContains(Output(), text);
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

void RemoveShmObjects(const std::string& prefix) {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* entry = readdir(dir)) {
    if (absl::StartsWith(entry->d_name, prefix + ".")) {
      shm_unlink(absl::StrCat("/", entry->d_name).c_str());
    }
  }
  closedir(dir);
}

namespace {

bool SocketAccepts(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return ok;
}

}  // namespace

absl::StatusOr<TestDaemon> TestDaemon::Start(const std::string& test_name,
                                             const std::vector<std::string>& extra_args,
                                             const std::vector<std::string>& env) {
  TestDaemon daemon;
  daemon.shm_prefix_ = absl::StrCat("tsmtest-", test_name, "-", getpid());
  RemoveShmObjects(daemon.shm_prefix_);
  daemon.dir_ =
      absl::StrCat(std::filesystem::temp_directory_path().string(), "/", daemon.shm_prefix_);
  std::filesystem::remove_all(daemon.dir_);
  std::filesystem::create_directories(daemon.dir_);
  daemon.socket_ = daemon.dir_ + "/tensorshm.sock";
  std::vector<std::string> argv = {TensorShmdPath(), "--socket",         daemon.socket_,
                                   "--shm-prefix",   daemon.shm_prefix_, "--log-level",
                                   "warning"};
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  absl::StatusOr<ChildProcess> process =
      ChildProcess::Start(argv, daemon.dir_ + "/daemon.log", env);
  if (!process.ok()) return process.status();
  daemon.process_ = std::make_unique<ChildProcess>(*std::move(process));
  if (!daemon.process_->WaitForOutput("serving on", absl::Seconds(20)) ||
      !SocketAccepts(daemon.socket_)) {
    // The status carries the log: its exit is the caller's to judge (the log is still checked).
    daemon.killed_on_purpose_ = true;
    return absl::UnavailableError(
        absl::StrCat("tensorshmd did not start: ", daemon.process_->Output()));
  }
  return daemon;
}

TestDaemon::TestDaemon(TestDaemon&& other) noexcept
    : dir_(std::exchange(other.dir_, "")),
      socket_(std::exchange(other.socket_, "")),
      shm_prefix_(std::exchange(other.shm_prefix_, "")),
      process_(std::move(other.process_)),
      killed_on_purpose_(std::exchange(other.killed_on_purpose_, false)) {}

TestDaemon& TestDaemon::operator=(TestDaemon&& other) noexcept {
  if (this == &other) return *this;
  Finish();
  dir_ = std::exchange(other.dir_, "");
  socket_ = std::exchange(other.socket_, "");
  shm_prefix_ = std::exchange(other.shm_prefix_, "");
  process_ = std::move(other.process_);
  killed_on_purpose_ = std::exchange(other.killed_on_purpose_, false);
  return *this;
}

TestDaemon::~TestDaemon() {
  Finish();
  if (!shm_prefix_.empty()) RemoveShmObjects(shm_prefix_);
  if (!dir_.empty()) std::filesystem::remove_all(dir_);
}

void TestDaemon::KillOnPurpose(int signal_number) {
  killed_on_purpose_ = true;
  if (process_ != nullptr) process_->Kill(signal_number);
}

std::string SanitizerReport(const std::string& log) {
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    for (absl::string_view sanitizer :
         {"AddressSanitizer", "LeakSanitizer", "ThreadSanitizer", "UndefinedBehaviorSanitizer",
          "MemorySanitizer", "runtime error:"}) {
      if (absl::StrContains(line, sanitizer)) return std::string(line);
    }
  }
  return "";
}

void TestDaemon::Finish() {
  if (process_ == nullptr) return;
  process_->Kill(SIGTERM);  // nothing if it already exited
  const absl::Duration limit = absl::Seconds(kSanitized ? 120 : 60);
  absl::StatusOr<int> status = process_->Wait(limit);
  std::string why;
  if (!status.ok()) {
    // Where it hangs, for the failure message: its threads, before the SIGKILL.
    const std::string stacks = ThreadStacks(process_->pid());
    process_->Kill(SIGKILL);
    (void)process_->Wait(absl::Seconds(10));
    why = absl::StrCat("did not exit within ", absl::FormatDuration(limit),
                       " of SIGTERM; its threads then:\n", stacks);
  } else if (!killed_on_purpose_ && !(WIFEXITED(*status) && WEXITSTATUS(*status) == 0)) {
    why = WIFSIGNALED(*status)
              ? absl::StrCat("was killed by signal ", WTERMSIG(*status),
                             " (a test that kills it on purpose says so: KillOnPurpose)")
              : absl::StrCat("exited ", WEXITSTATUS(*status), ", not 0");
  }
  const std::string log = process_->Output();
  if (const std::string report = SanitizerReport(log); !report.empty()) {
    absl::StrAppend(&why, why.empty() ? "" : "; ", "its log holds a sanitizer report: ", report);
  }
  if (!why.empty()) {
    ADD_FAILURE() << "tensorshmd " << shm_prefix_ << " " << why << "\n---- its log (" << dir_
                  << "/daemon.log) ----\n"
                  << log << "---- end of its log ----";
  }
  process_.reset();
  killed_on_purpose_ = false;
}

int TestDaemon::ShmObjectCount() const {
  int count = 0;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return -1;
  while (dirent* entry = readdir(dir)) {
    if (absl::StartsWith(entry->d_name, shm_prefix_ + ".")) ++count;
  }
  closedir(dir);
  return count;
}

}  // namespace tensorshm::testing
