// tensorshmctl: the operator's command line for tensorshmd.
//
//   tensorshmctl [--socket PATH] [--timeout DURATION] [--server-uid UID] [-o text|json] COMMAND
//     status           pools, tensors, names, leases, sessions
//     ls [PREFIX]      published tensors: name, dtype, shape, bytes, leases, age
//     inspect NAME     everything the daemon knows about one tensor
//     sessions         client sessions: pid, uid, client name, leases, unpublished bytes
//     rm NAME          unbind a name (its memory goes with its last lease)
//     health           exit 0 only when the daemon answers the gRPC health check SERVING
//     leftovers [PREFIX] [--remove]
//                      /dev/shm objects of prefixes no live daemon holds (killed daemons')
//
// Exit status: 0 done; 1 the daemon refused or could not be reached (health: not serving), with
// a one-line reason on stderr; 2 bad usage (a NAME no tensor can have included). JSON keys:
// docs/tensorshmctl.md.
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/admin.h"
#include "common/base/socket_path.h"
#include "common/tensor/name.h"
#include "tensorshm/client.h"
#include "tools/ctl/health.h"
#include "tools/ctl/leftovers.h"
#include "tools/ctl/report.h"

namespace tensorshm::ctl {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

struct GlobalOptions {
  std::string socket;  // resolved: --socket, else ClientSocketPath()
  absl::Duration timeout = absl::Seconds(5);
  std::optional<uint32_t> server_uid;
  bool json = false;
};

// "500ms", "2s", "1m" (absl::ParseDuration), or a bare number of seconds ("2", "0.5").
std::optional<absl::Duration> ParseTimeout(const std::string& text) {
  absl::Duration duration;
  double seconds = 0;
  if (absl::SimpleAtod(text, &seconds) && text.find_first_of("eEnN") == std::string::npos) {
    duration = absl::Seconds(seconds);
  } else if (!absl::ParseDuration(text, &duration)) {
    return std::nullopt;
  }
  if (duration <= absl::ZeroDuration() || duration == absl::InfiniteDuration()) return std::nullopt;
  return duration;
}

// Prints "tensorshmctl: WHAT: CODE: message" and returns the exit status of a failed command.
int Fail(const std::string& what, const absl::Status& status) {
  std::cerr << "tensorshmctl: " << what << ": " << absl::StatusCodeToString(status.code()) << ": "
            << status.message() << std::endl;
  return kExitFailed;
}

int Fail(const std::string& what, const tensorshm::Status& status) {
  std::cerr << "tensorshmctl: " << what << ": " << tensorshm::StatusCodeName(status.code()) << ": "
            << status.message() << std::endl;
  return kExitFailed;
}

void PrintJson(const nlohmann::json& document) {
  // Client names are the clients' words: bytes that are not UTF-8 are replaced, never fatal.
  std::cout << document.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
}

// Bounds a whole command by --timeout: a daemon that accepts but never answers (stopped with
// SIGSTOP, stuck) makes the command fail, never hang the operator or a script.
class Watchdog {
 public:
  // Connecting, then the answers: each may take up to `timeout`.
  Watchdog(absl::Duration timeout, std::string what, std::string socket)
      : thread_([this, timeout, what = std::move(what), socket = std::move(socket)] {
          if (done_.WaitForNotificationWithTimeout(2 * timeout)) return;
          std::fprintf(stderr,
                       "tensorshmctl: %s: DEADLINE_EXCEEDED: no answer from tensorshmd at "
                       "unix:%s (--timeout %s to connect, then %s for the answers)\n",
                       what.c_str(), socket.c_str(), absl::FormatDuration(timeout).c_str(),
                       absl::FormatDuration(timeout).c_str());
          std::fflush(stderr);
          _exit(kExitFailed);
        }) {}
  ~Watchdog() {
    done_.Notify();
    thread_.join();
  }

 private:
  absl::Notification done_;
  std::thread thread_;
};

int RunHealth(const GlobalOptions& options) {
  const absl::Status status = CheckHealth(options.socket, options.server_uid, options.timeout);
  if (options.json) {
    nlohmann::json report = {{"socket", options.socket},
                             {"serving", status.ok()},
                             {"reason", status.ok() ? "" : std::string(status.message())}};
    PrintJson(report);
  } else if (status.ok()) {
    std::cout << "SERVING" << std::endl;
  }
  return status.ok() ? kExitOk : Fail("health", status);
}

int RunLeftovers(const GlobalOptions& options, const std::string& prefix, bool remove) {
  bool failed = false;
  const nlohmann::json report = LeftoversReport(prefix, remove, &failed);
  options.json ? PrintJson(report) : void(std::cout << LeftoversText(report, remove));
  if (failed) {
    std::cerr << "tensorshmctl: leftovers: some objects could not be "
              << (remove ? "removed" : "checked") << " (see above)" << std::endl;
  }
  return failed ? kExitFailed : kExitOk;
}

struct Command {
  std::string verb;    // status, ls, inspect, sessions, rm
  std::string target;  // PREFIX of ls, NAME of inspect and rm
};

int RunWithClient(const GlobalOptions& options, const Command& command) {
  std::string what = command.verb;
  if (command.verb == "inspect" || command.verb == "rm") {
    absl::StrAppend(&what, " \"", command.target, "\"");
  }
  // Connect waits for a daemon that is starting; a socket that is not there at all fails now.
  if (struct stat st; stat(options.socket.c_str(), &st) != 0) {
    const int err = errno;
    return Fail(what, absl::UnavailableError(absl::StrCat(
                          "socket ", options.socket, ": ", std::strerror(err),
                          " (is tensorshmd running? --socket or $TENSORSHM_SOCKET name its "
                          "socket)")));
  }
  Watchdog watchdog(options.timeout, what, options.socket);
  ClientOptions client_options;
  client_options.socket = options.socket;
  client_options.client_name = "tensorshmctl";
  client_options.connect_timeout = absl::ToChronoNanoseconds(options.timeout);
  client_options.server_uid = options.server_uid;
  tensorshm::StatusOr<std::shared_ptr<Client>> client = Client::Connect(client_options);
  if (!client.ok()) return Fail(what, client.status());
  const int64_t now = absl::ToUnixMillis(absl::Now());

  if (command.verb == "status") {
    tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
    if (!stats.ok()) return Fail(what, stats.status());
    const nlohmann::json report = StatusReport(*stats);
    options.json ? PrintJson(report) : void(std::cout << StatusText(report));
  } else if (command.verb == "ls") {
    tensorshm::StatusOr<std::vector<TensorInfo>> tensors = (*client)->List(command.target);
    if (!tensors.ok()) return Fail(what, tensors.status());
    const nlohmann::json report = ListReport(*tensors, now);
    options.json ? PrintJson(report) : void(std::cout << ListText(report, command.target));
  } else if (command.verb == "inspect") {
    // List by the name as a prefix, then the exact name: List is the one call that describes a
    // tensor without taking a lease on it.
    tensorshm::StatusOr<std::vector<TensorInfo>> tensors = (*client)->List(command.target);
    if (!tensors.ok()) return Fail(what, tensors.status());
    const TensorInfo* found = nullptr;
    for (const TensorInfo& tensor : *tensors) {
      if (tensor.name == command.target) found = &tensor;
    }
    if (found == nullptr) {
      return Fail(what, absl::NotFoundError(absl::StrCat(
                            "name = \"", command.target,
                            "\": no tensor is published under this name (tensorshmctl ls lists "
                            "the names)")));
    }
    const nlohmann::json report = TensorReport(*found, now);
    options.json ? PrintJson(report) : void(std::cout << InspectText(report));
  } else if (command.verb == "sessions") {
    tensorshm::StatusOr<std::vector<SessionInfo>> sessions = (*client)->Sessions();
    if (!sessions.ok()) return Fail(what, sessions.status());
    const nlohmann::json report = SessionsReport(*sessions, now);
    options.json ? PrintJson(report) : void(std::cout << SessionsText(report));
  } else if (command.verb == "rm") {
    if (tensorshm::Status s = (*client)->Delete(command.target); !s.ok()) return Fail(what, s);
    if (options.json) {
      PrintJson({{"deleted", command.target}});
    } else {
      std::cout << "deleted \"" << command.target << "\"" << std::endl;
    }
  }
  return kExitOk;
}

constexpr char kJsonKeys[] = "JSON keys (-o json): see docs/tensorshmctl.md";

int Main(int argc, char** argv) {
  CLI::App app("Operate tensorshmd: its pools, tensors, sessions and health.", "tensorshmctl");
  app.footer(
      "Exit status: 0 done; 1 the daemon refused, could not be reached, or (health) is not "
      "serving, with a one-line reason on stderr; 2 bad usage.");
  app.set_version_flag("--version", "tensorshmctl " TENSORSHM_VERSION,
                       "Print tensorshmctl's version and exit");
  app.require_subcommand(1);
  app.fallthrough();  // global options may follow the subcommand: tensorshmctl ls -o json

  std::string socket;
  app.add_option("--socket", socket,
                 "The daemon's socket. Default: $TENSORSHM_SOCKET, else the user's own "
                 "($XDG_RUNTIME_DIR/tensorshm.sock, else /tmp/tensorshm-$UID/tensorshm.sock) "
                 "when a socket is there, else the system daemon's /run/tensorshm/tensorshm.sock "
                 "when one is there");
  std::string timeout_text = "5s";
  app.add_option("--timeout", timeout_text,
                 "Longest wait for the daemon to accept the connection, and again for its answers "
                 "(500ms, 2s, 1m, or seconds)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            return ParseTimeout(text) ? ""
                                      : absl::StrCat("--timeout = \"", text,
                                                     "\": not a positive duration; use e.g. "
                                                     "500ms, 2s, 1m, or a number of seconds");
          },
          "DURATION"))
      ->capture_default_str();
  uint32_t server_uid = 0;
  CLI::Option* server_uid_option = app.add_option(
      "--server-uid", server_uid,
      "Also trust a daemon run by this uid (default: $TENSORSHM_SERVER_UID; trusted anyway: this "
      "process's uid, root, and the packaged daemon of /run/tensorshm/tensorshm.sock in a "
      "directory only root could have made for it)");
  std::string output = "text";
  app.add_option("-o,--output", output, "Output format")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();

  Command command;
  CLI::App* status = app.add_subcommand("status",
                                        "Pools (capacity, used, segments), tensors, "
                                        "names, leases and sessions");
  CLI::App* ls = app.add_subcommand("ls",
                                    "Published tensors: name, dtype, shape, bytes, leases, "
                                    "age since publish");
  ls->add_option("PREFIX", command.target, "Only names starting with this");
  CLI::App* inspect = app.add_subcommand(
      "inspect", "Everything the daemon knows about one tensor; exit 1 if NAME is not published");
  inspect->add_option("NAME", command.target, "The tensor's name")->required();
  CLI::App* sessions = app.add_subcommand(
      "sessions",
      "Client sessions: pid, uid, client name, leases, unpublished tensors and bytes (another "
      "uid's sessions come without pid, gid and client name unless run as the daemon's uid or "
      "root)");
  CLI::App* rm = app.add_subcommand(
      "rm", "Unbind NAME; its memory is freed when its last lease ends. Exit 1 if unbound");
  rm->add_option("NAME", command.target, "The tensor's name")->required();
  CLI::App* health = app.add_subcommand(
      "health",
      "Exit 0 only if the daemon answers the standard gRPC health check (grpc.health.v1) "
      "SERVING, else 1 with the reason. Opens no tensorshm session: for exec probes");
  CLI::App* leftovers = app.add_subcommand(
      "leftovers",
      "The /dev/shm objects of shm prefixes no live tensorshmd holds (a daemon that was killed, "
      "or stopped with --keep-segments): this user's, every user's as root. Opens no session");
  std::string leftover_prefix;
  leftovers->add_option("PREFIX", leftover_prefix, "Only this shm prefix (--shm-prefix)");
  bool remove_leftovers = false;
  leftovers->add_flag("--remove", remove_leftovers,
                      "Remove them (a live daemon's objects are never touched)");
  for (CLI::App* sub : {status, ls, inspect, sessions, rm, health, leftovers}) {
    sub->footer(kJsonKeys);
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string help = "tensorshmctl --help";
    for (const CLI::App* sub : app.get_subcommands()) {
      help = absl::StrCat("tensorshmctl ", sub->get_name(), " --help");
    }
    if (app.get_subcommands().empty() && !app.remaining().empty()) {
      std::cerr << "tensorshmctl: unknown subcommand \"" << app.remaining().front()
                << "\": use status, ls, inspect, sessions, rm, health or leftovers (see " << help
                << ")" << std::endl;
    } else {
      std::cerr << "tensorshmctl: " << e.what() << " (see " << help << ")" << std::endl;
    }
    return kExitUsage;
  }

  // A NAME or PREFIX no tensor can have is the caller's mistake, told before any connection.
  for (CLI::App* sub : {ls, inspect, rm}) {
    if (!sub->parsed()) continue;
    const bool prefix = sub == ls;
    const absl::Status valid = prefix ? ValidateNamePrefix(command.target, "PREFIX")
                                      : ValidateName(command.target, "NAME");
    if (!valid.ok()) {
      std::cerr << "tensorshmctl: " << sub->get_name() << ": " << valid.message()
                << " (see tensorshmctl " << sub->get_name() << " --help)" << std::endl;
      return kExitUsage;
    }
  }

  if (leftovers->parsed() && !leftover_prefix.empty() &&
      (leftover_prefix.size() > 48 ||
       !std::all_of(leftover_prefix.begin(), leftover_prefix.end(),
                    [](char c) { return absl::ascii_isalnum(c) || c == '-' || c == '_'; }))) {
    std::cerr << "tensorshmctl: leftovers: PREFIX = \"" << leftover_prefix
              << "\": an shm prefix is 1-48 characters of [A-Za-z0-9_-] (see tensorshmctl "
                 "leftovers --help)"
              << std::endl;
    return kExitUsage;
  }

  GlobalOptions options;
  options.socket = socket.empty() ? ClientSocketPath() : socket;
  options.timeout = *ParseTimeout(timeout_text);
  absl::StatusOr<std::optional<uint32_t>> trusted = ServerUidOrEnvironment(
      *server_uid_option ? std::optional<uint32_t>(server_uid) : std::nullopt);
  if (!trusted.ok()) {
    std::cerr << "tensorshmctl: " << trusted.status().message() << std::endl;
    return kExitUsage;
  }
  options.server_uid = *trusted;
  options.json = output == "json";
  if (health->parsed()) return RunHealth(options);
  if (leftovers->parsed()) return RunLeftovers(options, leftover_prefix, remove_leftovers);
  for (CLI::App* sub : {status, ls, inspect, sessions, rm}) {
    if (sub->parsed()) command.verb = sub->get_name();
  }
  return RunWithClient(options, command);
}

}  // namespace
}  // namespace tensorshm::ctl

int main(int argc, char** argv) { return tensorshm::ctl::Main(argc, argv); }
