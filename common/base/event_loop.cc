#include "common/base/event_loop.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/base/sys_error.h"

namespace tensorshm {
namespace {

// The key of the eventfd's reports; a watched descriptor's key has a generation >= 1 above it.
constexpr uint64_t kWakeKey = ~uint64_t{0};
// Reports taken per epoll_wait.
constexpr int kBatch = 64;

uint64_t Key(int fd, uint32_t generation) {
  return (uint64_t{generation} << 32) | static_cast<uint32_t>(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<EventLoop>> EventLoop::Create(absl::string_view name) {
  UniqueFd epoll(epoll_create1(EPOLL_CLOEXEC));
  if (!epoll) return ErrnoError("epoll_create1", name, errno);
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) return ErrnoError("eventfd", name, errno);
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = kWakeKey;
  if (epoll_ctl(epoll.get(), EPOLL_CTL_ADD, wake.get(), &event) != 0) {
    return ErrnoError("epoll_ctl", name, errno);
  }
  return std::unique_ptr<EventLoop>(
      new EventLoop(std::string(name), std::move(epoll), std::move(wake)));
}

EventLoop::~EventLoop() = default;

absl::Status EventLoop::Watch(int fd, uint32_t events, Callback callback) {
  MutexLock lock(&mu_);
  const uint32_t generation = next_generation_++;
  if (next_generation_ == 0) next_generation_ = 1;
  epoll_event event{};
  event.events = events;
  event.data.u64 = Key(fd, generation);
  // Under the lock: a report of `fd` finds its callback however soon it comes.
  if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &event) != 0) {
    return ErrnoError("epoll_ctl", absl::StrCat(name_, " fd ", fd), errno);
  }
  watchers_[fd] = Watcher{generation, std::make_unique<Callback>(std::move(callback))};
  return absl::OkStatus();
}

void EventLoop::Unwatch(int fd) {
  MutexLock lock(&mu_);
  auto it = watchers_.find(fd);
  if (it == watchers_.end()) return;
  epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
  retired_.push_back(std::move(it->second.callback));
  watchers_.erase(it);
  retired_pending_.store(true, std::memory_order_release);
}

absl::StatusOr<int> EventLoop::Poll(int timeout_ms) {
  if (stopped()) return 0;
  epoll_event events[kBatch];
  const int n = epoll_wait(epoll_.get(), events, kBatch, timeout_ms);
  if (n < 0) {
    if (errno == EINTR) return 0;
    return ErrnoError("epoll_wait", name_, errno);
  }
  for (int i = 0; i < n && !stopped(); ++i) {
    const uint64_t key = events[i].data.u64;
    if (key == kWakeKey) {
      // Drained, so that the next Poll waits again. Once stopped it is left signalled.
      uint64_t count;
      [[maybe_unused]] const ssize_t drained = read(wake_.get(), &count, sizeof(count));
      continue;
    }
    const int fd = static_cast<int>(static_cast<uint32_t>(key));
    Callback* callback = nullptr;
    {
      MutexLock lock(&mu_);
      auto it = watchers_.find(fd);
      if (it == watchers_.end() || Key(fd, it->second.generation) != key) continue;
      // Stays alive through the call: Unwatch retires it, and retired callbacks outlive the batch.
      callback = it->second.callback.get();
    }
    (*callback)(events[i].events);
  }
  // A plain load first: the exchange (a locked instruction) only when something was retired.
  if (retired_pending_.load(std::memory_order_relaxed) &&
      retired_pending_.exchange(false, std::memory_order_acquire)) {
    MutexLock lock(&mu_);
    retired_.clear();
  }
  return n;
}

void EventLoop::Wake() {
  const uint64_t one = 1;
  // Fails only when the counter would overflow, which means a wake-up is pending anyway.
  [[maybe_unused]] const ssize_t written = write(wake_.get(), &one, sizeof(one));
}

void EventLoop::Stop() {
  stopped_.store(true, std::memory_order_release);
  Wake();
}

}  // namespace tensorshm
