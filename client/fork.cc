#include "client/fork.h"

#include <dirent.h>
#include <fcntl.h>
#include <grpc/fork.h>
#include <grpc/grpc.h>
#include <pthread.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/base/unique_fd.h"

namespace tensorshm {
namespace {

// Bumped in every child that fork() makes: a ClientCore made under another value belongs to an
// ancestor process, whose connections, threads and leases the child must never touch.
std::atomic<uint64_t> g_fork_generation{0};

// The daemon sockets this process connected to, for the fork handler, which runs in the child
// and so takes no locks: a slot is claimed with an atomic counter, filled, then marked ready.
constexpr int kMaxDaemonSockets = 16;
struct SocketSlot {
  std::atomic<bool> ready{false};
  char path[sizeof(sockaddr_un::sun_path)];
};
SocketSlot g_sockets[kMaxDaemonSockets];
std::atomic<int> g_socket_slots{0};

bool IsDaemonSocket(const char* path) {
  const int slots = std::min(g_socket_slots.load(std::memory_order_acquire), kMaxDaemonSockets);
  for (int i = 0; i < slots; ++i) {
    if (g_sockets[i].ready.load(std::memory_order_acquire) &&
        std::strncmp(path, g_sockets[i].path, sizeof(SocketSlot::path)) == 0) {
      return true;
    }
  }
  return false;
}

// In a new child: every inherited connection to a daemon socket (the parent's gRPC connections
// and memory channels) is replaced, in this process only, by a socket whose peer is gone. The
// child's copy of gRPC's state can then never write into the parent's HTTP/2 stream (a copied
// timer firing, a copied call being cancelled): it reads end-of-stream and gives up. The
// parent's connections are untouched.
void CutInheritedConnections() {
  if (g_socket_slots.load(std::memory_order_acquire) == 0) return;
  DIR* fds = opendir("/proc/self/fd");
  if (fds == nullptr) return;
  int cut[1024];
  int count = 0;
  while (dirent* entry = readdir(fds)) {
    if (entry->d_name[0] == '.') continue;
    const int fd = std::atoi(entry->d_name);
    struct stat st;
    sockaddr_un peer{};
    socklen_t length = sizeof(peer);
    if (fd == dirfd(fds) || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode) ||
        getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0 ||
        peer.sun_family != AF_UNIX || length <= offsetof(sockaddr_un, sun_path)) {
      continue;
    }
    if (IsDaemonSocket(peer.sun_path) && count < 1024) cut[count++] = fd;
  }
  closedir(fds);
  for (int i = 0; i < count; ++i) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) return;
    UniqueFd end(pair[0]);
    UniqueFd other(pair[1]);
    other.reset();  // at once: `end` reads end-of-stream
    // Best effort: should dup3 fail, the child still never uses the parent's objects.
    (void)dup3(end.get(), cut[i], O_CLOEXEC);
  }
}

// As gRPC reads a boolean setting: "1", "true" or "yes", in any case.
bool IsTrue(const char* value) {
  return strcmp(value, "1") == 0 || strcasecmp(value, "true") == 0 || strcasecmp(value, "yes") == 0;
}

void OnForkChild() {
  g_fork_generation.fetch_add(1, std::memory_order_relaxed);
  CutInheritedConnections();
}

// A forked child's references to its parent's cores (see KeepForever).
struct ForkLeftover {
  std::shared_ptr<ClientCore> core;
  std::thread* sender;
  ForkLeftover* next;
};
std::atomic<ForkLeftover*> g_fork_leftovers{nullptr};

// Senders tearing their channel down, and whether exit() has begun. Never destroyed: exit runs
// destructors of statics, and this must outlive them all.
struct ExitState {
  std::mutex mu;
  std::condition_variable idle;
  bool exiting = false;
  int teardowns = 0;
};

ExitState& Exit() {
  static ExitState* state = new ExitState;
  return *state;
}

void OnProcessExit() {
  ExitState& state = Exit();
  std::unique_lock<std::mutex> lock(state.mu);
  state.exiting = true;
  state.idle.wait_for(lock, std::chrono::seconds(5), [&] { return state.teardowns == 0; });
}

}  // namespace

uint64_t ForkGeneration() { return g_fork_generation.load(std::memory_order_relaxed); }

void RememberDaemonSocket(const std::string& path) {
  if (path.empty() || path.size() >= sizeof(SocketSlot::path) || IsDaemonSocket(path.c_str())) {
    return;
  }
  const int slot = g_socket_slots.fetch_add(1, std::memory_order_acq_rel);
  if (slot >= kMaxDaemonSockets) return;
  std::memcpy(g_sockets[slot].path, path.c_str(), path.size() + 1);
  g_sockets[slot].ready.store(true, std::memory_order_release);
}

// gRPC's default polling strategy (epoll1) keeps its poll set in one kernel epoll instance,
// which a forked child shares with its parent: should gRPC's fork handler not run (it skips
// itself while another thread is inside a gRPC call), a child that connects would register its
// sockets in the parent's set, and the parent's pollers would receive events carrying the
// child's pointers. "poll" keeps that state in process memory. gRPC reads the variable when it
// starts, so it is set only around that start: processes this one spawns do not inherit it.
bool BeginSenderTeardown() {
  ExitState& state = Exit();
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.exiting) return false;
  ++state.teardowns;
  return true;
}

void EndSenderTeardown() {
  ExitState& state = Exit();
  std::lock_guard<std::mutex> lock(state.mu);
  if (--state.teardowns == 0) state.idle.notify_all();
}

void PrepareProcessForClients() {
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork(nullptr, nullptr, OnForkChild);
    // Registered after gRPC's statics (gRPC is loaded before this runs), so it runs before them.
    Exit();
    std::atexit(OnProcessExit);
    // gRPC reads its settings from the environment once, at the first call that asks it about
    // itself (grpc_is_initialized too): they are set here for that call alone (the program's own
    // choices kept), then taken back, so that programs this one starts do not inherit them. A
    // program that used gRPC before keeps the settings it had (it may set
    // GRPC_ENABLE_FORK_SUPPORT=1 itself).
    //  - fork support: gRPC's handlers, registered below, stop gRPC's threads before a fork and,
    //    in the child, reset its locks, threads and poller, so that the child can use gRPC
    //    afresh. Debian's gRPC registers none itself.
    //  - the poll strategy: poll, the one besides epoll1 that fork support works with.
    const char* fork_choice = getenv("GRPC_ENABLE_FORK_SUPPORT");
    const bool choose_fork = fork_choice == nullptr;
    const bool choose_poll = getenv("GRPC_POLL_STRATEGY") == nullptr;
    if (choose_fork) setenv("GRPC_ENABLE_FORK_SUPPORT", "1", /*overwrite=*/0);
    if (choose_poll) setenv("GRPC_POLL_STRATEGY", "poll", /*overwrite=*/0);
    const bool first = !grpc_is_initialized();
    // Held for the life of the process: gRPC never restarts with other settings.
    if (first) grpc_init();
    if (choose_poll) unsetenv("GRPC_POLL_STRATEGY");
    if (choose_fork) unsetenv("GRPC_ENABLE_FORK_SUPPORT");
    // Fork support is on: the handlers (which complain on every fork while it is off).
    if (first && (choose_fork || IsTrue(fork_choice))) {
      pthread_atfork(grpc_prefork, grpc_postfork_parent, grpc_postfork_child);
    }
  });
}

void KeepForever(std::shared_ptr<ClientCore> core, std::thread* sender) {
  auto* node = new ForkLeftover{std::move(core), sender, g_fork_leftovers.load()};
  while (!g_fork_leftovers.compare_exchange_weak(node->next, node)) {
  }
}

}  // namespace tensorshm
