#include "tests/support/ctl_run.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace tensorshm::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

}  // namespace

nlohmann::json CtlRun::Json() const {
  nlohmann::json parsed = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(parsed.is_discarded()) << "stdout is not JSON: " << out << "\nstderr: " << err;
  return parsed.is_discarded() ? nlohmann::json() : parsed;
}

CtlRun RunCtl(const std::string& dir, const std::vector<std::string>& args,
              const std::vector<std::string>& env, int as_uid) {
  static int runs = 0;
  ++runs;
  // The pid too: tests of other processes (ctest -j) run in the same directory (TempDir()).
  const std::string out_path = absl::StrCat(dir, "/ctl-", getpid(), "-", runs, ".out");
  const std::string err_path = absl::StrCat(dir, "/ctl-", getpid(), "-", runs, ".err");
  std::vector<std::string> argv;
  if (as_uid >= 0) {
    argv = {"/usr/bin/setpriv",     "--reuid",       std::to_string(as_uid), "--regid",
            std::to_string(as_uid), "--clear-groups"};
  }
  argv.push_back(TENSORSHMCTL_PATH);
  argv.insert(argv.end(), args.begin(), args.end());

  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    bool dropped = name == "TENSORSHM_SOCKET";
    for (const std::string& extra : env) dropped |= extra.substr(0, extra.find('=')) == name;
    if (!dropped) environment.push_back(entry);
  }
  environment.insert(environment.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (const std::string& e : environment) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  std::vector<char*> argp;
  for (const std::string& a : argv) argp.push_back(const_cast<char*>(a.c_str()));
  argp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, argp[0], &actions, nullptr, argp.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  CtlRun run;
  if (spawned != 0) {
    ADD_FAILURE() << "posix_spawn " << argp[0] << ": " << spawned;
    return run;
  }
  int status = 0;
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "tensorshmctl did not end within a minute";
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  if (WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  run.out = ReadFile(out_path);
  run.err = ReadFile(err_path);
  unlink(out_path.c_str());
  unlink(err_path.c_str());
  return run;
}

std::string LineWith(const std::string& text, const std::string& needle) {
  const size_t at = text.find(needle);
  if (at == std::string::npos) return "";
  return text.substr(at, text.find('\n', at) - at);
}

}  // namespace tensorshm::testing
