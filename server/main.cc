// tensorshmd: the tensorshm daemon. Flags in, a Daemon (server/daemon.h) started and served.
#include <signal.h>
#include <sys/stat.h>

#include <iostream>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "server/daemon.h"
#include "server/ops/log.h"
#include "server/ops/options.h"

namespace tensorshm {
namespace {

int Run(int argc, char** argv) {
  const absl::Time started = absl::Now();
  absl::StatusOr<DaemonOptions> options = ParseOptions(argc, argv);
  if (!options.ok()) {
    std::cerr << "tensorshmd: " << options.status().message() << "\n";
    return 2;
  }
  if (options->help) {
    std::cout << Usage();
    return 0;
  }
  if (options->version) {
    // The one version of tensorshm: CMake's project VERSION, also the Python package's.
    std::cout << "tensorshmd " << TENSORSHM_VERSION << "\n";
    return 0;
  }
  SetLogLevel(options->log_level);
  if (!options->config_file.empty()) {
    TSM_LOG(kInfo) << "flags from " << options->config_file << ", and the command line over them";
  }
  // Everything the daemon creates (socket, its directory, shm objects) is private to its user.
  umask(077);
  signal(SIGPIPE, SIG_IGN);
  // SIGTERM and SIGINT are taken by one thread with sigwait; block them before any other thread
  // starts so that they inherit the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(*options, started);
  if (!daemon.ok()) {
    std::cerr << "tensorshmd: " << daemon.status().message() << "\n";
    return 1;
  }
  (*daemon)->Serve(stop_signals);
  return 0;
}

}  // namespace
}  // namespace tensorshm

int main(int argc, char** argv) { return tensorshm::Run(argc, argv); }
