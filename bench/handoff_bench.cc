// handoff_bench: hands a tensor from a producer process to a consumer process through tensorshm,
// and the same bytes through a gRPC bytes field on the same kind of socket, and prints medians
// next to a warm memcpy of the same bytes.
//
//   handoff_bench [--sizes 4Ki,1Mi,64Mi,1Gi] [--max-iterations N]
//
// tensorshm handoff: producer create + fill + publish -> consumer (already waiting in Acquire)
//   acquire + read one byte per page. Measured from the producer's start to the consumer's last
//   read, on CLOCK_MONOTONIC, which both processes share. The first handoff of each size is
//   printed on its own row ("cold"); the main row is the median of the others (steady state).
// faults p/c: page faults (getrusage ru_minflt deltas) per handoff, measured inside the producer
//   around create + fill + publish and inside the consumer around acquire + read + release;
//   medians of the steady-state handoffs (the cold row: the first handoff's).
// warm memcpy: a memcpy of the same bytes into an already-touched destination, in a child
//   process spawned as the producer is; handoff / memcpy is the tensorshm row's ratio to it.
// tensorshm acquire (warm): the consumer acquiring the same, already published tensor again
//   and reading one byte per page (segment mapping cached, as in a long-running consumer).
// gRPC bytes: producer fills a buffer and sends it in a unary call to the consumer's server,
//   whose handler reads one byte per page; measured from the fill's start to that last read.
// No idle gap on either handoff row: the driver starts each handoff as soon as the previous one
//   has ended (tensorshm: and the consumer has said it is about to wait), and the gRPC row runs
//   right after the tensorshm row of the same size.
// empty RPC: round trip of an empty unary call on the same socket: the floor of any RPC.
//
// The CUDA row (device memory on cuda:0, where a driver and a device are present; skipped with
// the reason elsewhere): handoff = producer create + fill (host-to-device copy) + publish with a
// ready event -> consumer acquire, waiting on the event; acquire = warm re-acquire; memcpy = a
// device-to-device cuMemcpy of the same bytes in the consumer, the cost tensorshm avoids.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/unique_fd.h"
#include "common/cuda/cuda_driver.h"
#include "handoff_roles.h"
#include "tensorshm/client.h"

extern char** environ;

namespace handoff {
namespace {

// The daemon: $TENSORSHMD, else the build's (a bundle sets TENSORSHMD).
std::string Tensorshmd() {
  const char* path = std::getenv("TENSORSHMD");
  return path != nullptr && *path != '\0' ? path : TENSORSHMD_PATH;
}

uint64_t ParseSize(const std::string& text) {
  size_t end = 0;
  const uint64_t n = std::stoull(text, &end);
  const std::string suffix = text.substr(end);
  if (suffix.empty()) return n;
  if (suffix == "Ki") return n << 10;
  if (suffix == "Mi") return n << 20;
  if (suffix == "Gi") return n << 30;
  std::cerr << "bad size " << text << "\n";
  std::exit(2);
}

std::string FormatSize(uint64_t bytes) {
  if (bytes >= (1u << 30) && bytes % (1u << 30) == 0) return absl::StrFormat("%d GiB", bytes >> 30);
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return absl::StrFormat("%d MiB", bytes >> 20);
  if (bytes >= (1u << 10) && bytes % (1u << 10) == 0) return absl::StrFormat("%d KiB", bytes >> 10);
  return absl::StrFormat("%d B", bytes);
}

std::string FormatNs(double ns) {
  if (ns < 1e3) return absl::StrFormat("%.0f ns", ns);
  if (ns < 1e6) return absl::StrFormat("%.1f us", ns / 1e3);
  if (ns < 1e9) return absl::StrFormat("%.2f ms", ns / 1e6);
  return absl::StrFormat("%.2f s", ns / 1e9);
}

struct Child {
  pid_t pid = -1;
  FILE* in = nullptr;   // the child's stdin
  FILE* out = nullptr;  // the child's stdout

  static Child Spawn(const std::vector<std::string>& argv) {
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) std::abort();
    // The child's ends are closed here once it has its copies; ours go to stdio.
    tensorshm::UniqueFd child_stdin(to_child[0]);
    tensorshm::UniqueFd child_stdout(from_child[1]);
    tensorshm::UniqueFd to(to_child[1]);
    tensorshm::UniqueFd from(from_child[0]);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, child_stdin.get(), STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, child_stdout.get(), STDOUT_FILENO);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    Child child;
    if (posix_spawn(&child.pid, args[0], &actions, nullptr, args.data(), environ) != 0) {
      std::perror("posix_spawn");
      std::exit(1);
    }
    posix_spawn_file_actions_destroy(&actions);
    child_stdin.reset();
    child_stdout.reset();
    child.in = fdopen(to.release(), "w");  // the FILE closes it (fclose)
    child.out = fdopen(from.release(), "r");
    return child;
  }

  void Send(const std::string& line) {
    std::fputs((line + "\n").c_str(), in);
    std::fflush(in);
  }

  // The next line starting with `key`, split into words after it.
  std::vector<std::string> Expect(const std::string& key) {
    char buffer[512];
    while (std::fgets(buffer, sizeof(buffer), out) != nullptr) {
      std::vector<std::string> words =
          absl::StrSplit(absl::StripTrailingAsciiWhitespace(buffer), ' ', absl::SkipEmpty());
      if (!words.empty() && words[0] == key) return {words.begin() + 1, words.end()};
    }
    std::cerr << "child " << pid << " ended before sending '" << key << "'\n";
    std::exit(1);
  }

  void Finish() {
    std::fclose(in);
    int status;
    waitpid(pid, &status, 0);
    std::fclose(out);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::cerr << "child " << pid << " failed (status " << status << ")\n";
      std::exit(1);
    }
  }
};

// Waits until the daemon's socket is there: it logs "serving on" (on stderr) right after.
void WaitForSocket(const std::string& socket) {
  for (int i = 0; i < 400; ++i) {
    if (std::filesystem::exists(socket)) return;
    absl::SleepFor(absl::Milliseconds(50));
  }
  std::cerr << "tensorshmd did not make " << socket << " within 20 s\n";
  std::exit(1);
}

// ---- the driver ----

struct Row {
  uint64_t size;
  int iterations;  // steady-state handoffs (after the cold one)
  double cold_handoff, cold_producer_faults, cold_consumer_faults;
  double tsm_handoff, producer_faults, consumer_faults, tsm_warm;
  double memcpy;
  double grpc_bytes, ping;
};

// The warm memcpy first, then the tensorshm row and the gRPC row back to back.
Row Measure(const std::string& self, const std::string& dir, const std::string& tsm_socket,
            uint64_t size, int iterations) {
  Row row{};
  row.size = size;
  row.iterations = iterations;
  const std::string size_arg = std::to_string(size);
  const std::string iter_arg = std::to_string(iterations);
  const std::string handoffs_arg = std::to_string(iterations + 1);  // the cold one first
  {
    Child copier = Child::Spawn({self, "--role", "memcpy", "-", size_arg, iter_arg});
    row.memcpy = std::stod(copier.Expect("memcpy").at(0));
    copier.Finish();
  }
  {
    Child consumer =
        Child::Spawn({self, "--role", "tsm-consumer", tsm_socket, size_arg, handoffs_arg});
    Child producer =
        Child::Spawn({self, "--role", "tsm-producer", tsm_socket, size_arg, handoffs_arg});
    std::vector<int64_t> handoff, warm, producer_faults, consumer_faults;
    for (int i = 0; i <= iterations; ++i) {
      consumer.Expect("ready");  // no idle gap: go at once
      producer.Send("go");
      std::vector<std::string> start = producer.Expect("start");
      std::vector<std::string> end = consumer.Expect("end");
      const int64_t took = std::stoll(end.at(0)) - std::stoll(start.at(0));
      if (i == 0) {
        row.cold_handoff = took;
        row.cold_producer_faults = std::stod(start.at(1));
        row.cold_consumer_faults = std::stod(end.at(2));
        continue;
      }
      handoff.push_back(took);
      warm.push_back(std::stoll(end.at(1)));
      producer_faults.push_back(std::stoll(start.at(1)));
      consumer_faults.push_back(std::stoll(end.at(2)));
    }
    producer.Finish();
    consumer.Finish();
    row.tsm_handoff = Median(handoff);
    row.tsm_warm = Median(warm);
    row.producer_faults = Median(producer_faults);
    row.consumer_faults = Median(consumer_faults);
  }
  {
    const std::string socket = dir + "/bytes.sock";
    std::filesystem::remove(socket);
    Child consumer = Child::Spawn({self, "--role", "grpc-consumer", socket, size_arg, iter_arg});
    consumer.Expect("listening");
    Child producer =
        Child::Spawn({self, "--role", "grpc-producer", socket, size_arg, handoffs_arg});
    std::vector<int64_t> bytes;
    for (int i = 0; i <= iterations; ++i) {
      producer.Send("go");  // no idle gap, as in the tensorshm row
      const int64_t start = std::stoll(producer.Expect("start").at(0));
      const int64_t took = std::stoll(consumer.Expect("end").at(0)) - start;
      if (i > 0) bytes.push_back(took);  // the first call also sets up the connection
    }
    row.ping = std::stod(producer.Expect("ping").at(0));
    producer.Finish();
    consumer.Finish();
    row.grpc_bytes = Median(bytes);
  }
  return row;
}

std::string Faults(double producer, double consumer) {
  return absl::StrFormat("%.0f/%.0f", producer, consumer);
}

// Prints the CUDA row for `size` (on a daemon with a cuda:0 pool), or why it is skipped.
void CudaRow(const std::string& self, const std::string& dir, uint64_t size, int iterations) {
  const absl::Status available = CudaAvailable();
  if (!available.ok()) {
    std::printf("\ncuda:0   skipped: %s\n", std::string(available.message()).c_str());
    return;
  }
  const std::string socket = dir + "/cuda.sock";
  Child daemon =
      Child::Spawn({Tensorshmd(), "--socket", socket, "--host-pool", "64Mi", "--cuda-pool",
                    absl::StrFormat("cuda:0=%dB", size + (64 << 20)), "--log-level", "warning"});
  WaitForSocket(socket);
  const std::string size_arg = std::to_string(size);
  const std::string iter_arg = std::to_string(iterations);
  Child consumer = Child::Spawn({self, "--role", "cuda-consumer", socket, size_arg, iter_arg});
  Child producer = Child::Spawn({self, "--role", "cuda-producer", socket, size_arg, iter_arg});
  std::vector<int64_t> handoff, warm, copy;
  for (int i = 0; i < iterations; ++i) {
    consumer.Expect("ready");
    absl::SleepFor(absl::Milliseconds(2));
    producer.Send("go");
    const int64_t start = std::stoll(producer.Expect("start").at(0));
    std::vector<std::string> end = consumer.Expect("end");
    handoff.push_back(std::stoll(end.at(0)) - start);
    warm.push_back(std::stoll(end.at(1)));
    copy.push_back(std::stoll(end.at(2)));
  }
  consumer.Finish();
  producer.Finish();
  kill(daemon.pid, SIGTERM);
  daemon.Finish();
  std::printf("\n%-8s %6s %18s %18s %14s %15s   (driver %s)\n", "cuda:0", "iters",
              "tensorshm handoff", "tensorshm acquire", "D2D memcpy", "memcpy / acquire",
              DriverOrDie()->library().c_str());
  std::printf("%-8s %6d %18s %18s %14s %14.1fx\n", FormatSize(size).c_str(), iterations,
              FormatNs(Median(handoff)).c_str(), FormatNs(Median(warm)).c_str(),
              FormatNs(Median(copy)).c_str(), Median(copy) / Median(warm));
  std::fflush(stdout);
}

int Driver(const std::string& self, const std::vector<uint64_t>& sizes, int max_iterations) {
  const std::string dir = absl::StrFormat("/tmp/tsm-bench-%d", getpid());
  std::filesystem::create_directories(dir);
  const std::string socket = dir + "/tensorshm.sock";
  const uint64_t largest = *std::max_element(sizes.begin(), sizes.end());
  const uint64_t pool = largest + (512ull << 20);
  std::vector<std::string> argv = {
      Tensorshmd(),     "--socket", socket,        "--host-pool", std::to_string(pool) + "B",
      "--segment-size", "256Mi",    "--log-level", "warning"};
  Child daemon = Child::Spawn(argv);
  WaitForSocket(socket);

  std::cout << "handoff_bench: producer process -> consumer process, medians; CLOCK_MONOTONIC\n"
            << "  tensorshm handoff: create + fill + publish -> acquire + read a byte per page;\n"
            << "    steady state (a size seen before); the 'cold' row is the first handoff\n"
            << "  faults p/c: page faults per handoff in the producer / the consumer (ru_minflt)\n"
            << "  warm memcpy: memcpy of the same bytes into a touched buffer (its own process)\n"
            << "  tensorshm acquire: acquire (warm) + read a byte per page\n"
            << "  gRPC bytes: fill + unary call with a bytes field -> read a byte per page\n"
            << "  no idle gap before any handoff; the gRPC row runs right after the tensorshm row\n"
            << "  empty RPC: round trip of an empty unary call on the same kind of socket\n\n";
  std::printf("%-10s %6s %18s %12s %12s %9s %18s %12s %11s %9s\n", "size", "iters",
              "tensorshm handoff", "faults p/c", "warm memcpy", "/memcpy", "tensorshm acquire",
              "gRPC bytes", "empty RPC", "gRPC/tsm");
  for (uint64_t size : sizes) {
    const int iterations = static_cast<int>(
        std::clamp<uint64_t>((4ull << 30) / std::max<uint64_t>(size, 1), 5, max_iterations));
    Row r = Measure(self, dir, socket, size, iterations);
    std::printf("%-10s %6d %18s %12s %12s %8.2fx %18s %12s %11s %8.1fx\n", FormatSize(size).c_str(),
                r.iterations, FormatNs(r.tsm_handoff).c_str(),
                Faults(r.producer_faults, r.consumer_faults).c_str(), FormatNs(r.memcpy).c_str(),
                r.tsm_handoff / r.memcpy, FormatNs(r.tsm_warm).c_str(),
                FormatNs(r.grpc_bytes).c_str(), FormatNs(r.ping).c_str(),
                r.grpc_bytes / r.tsm_handoff);
    std::printf("%-10s %6d %18s %12s %12s %8.2fx\n", (FormatSize(size) + " cold").c_str(), 1,
                FormatNs(r.cold_handoff).c_str(),
                Faults(r.cold_producer_faults, r.cold_consumer_faults).c_str(), "",
                r.cold_handoff / r.memcpy);
    std::fflush(stdout);
  }
  kill(daemon.pid, SIGTERM);
  daemon.Finish();
  const uint64_t cuda_size = std::min<uint64_t>(largest, 1ull << 30);
  CudaRow(self, dir, cuda_size,
          static_cast<int>(std::clamp<uint64_t>((4ull << 30) / cuda_size, 5, max_iterations)));
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace handoff

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc >= 6 && std::string(argv[1]) == "--role") {
    const std::string role = argv[2];
    const std::string socket = argv[3];
    const uint64_t size = std::stoull(argv[4]);
    const int iterations = std::stoi(argv[5]);
    if (role == "tsm-producer") return handoff::TsmProducer(socket, size, iterations);
    if (role == "tsm-consumer") return handoff::TsmConsumer(socket, size, iterations);
    if (role == "memcpy") return handoff::WarmMemcpy(size, iterations);
    if (role == "grpc-producer") return handoff::GrpcProducer(socket, size, iterations);
    if (role == "grpc-consumer") return handoff::GrpcConsumer(socket);
    if (role == "cuda-producer") return handoff::CudaProducer(socket, size, iterations);
    if (role == "cuda-consumer") return handoff::CudaConsumer(socket, size, iterations);
    return 2;
  }
  std::vector<uint64_t> sizes = {4ull << 10, 1ull << 20, 64ull << 20, 1ull << 30};
  int max_iterations = 200;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--sizes" && i + 1 < argc) {
      sizes.clear();
      for (absl::string_view s : absl::StrSplit(argv[++i], ','))
        sizes.push_back(handoff::ParseSize(std::string(s)));
    } else if (arg == "--max-iterations" && i + 1 < argc) {
      max_iterations = std::max(5, std::stoi(argv[++i]));
    } else {
      std::cerr << "usage: handoff_bench [--sizes 4Ki,1Mi,64Mi,1Gi] [--max-iterations N]\n";
      return 2;
    }
  }
  return handoff::Driver(std::filesystem::canonical("/proc/self/exe").string(), sizes,
                         max_iterations);
}
