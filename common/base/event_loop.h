// EventLoop: one epoll set, the callbacks of the descriptors it watches, and an eventfd through
// which any thread stops (or wakes) the thread that polls it. The daemon's accept loop and its
// memory channel thread each run one. The loop has no thread of its own: its owner calls Poll()
// in a loop of its own making, so that each decides what to do between waits (the accept loop's
// deadlines, the memory channel's look for an expected request).
//
// Thread-safety: Watch(), Wake(), Stop() and stopped() from any thread; Poll() from one thread
// at a time (the loop's thread); Unwatch() from the loop's thread (a callback included), or
// while no thread polls.
#ifndef TENSORSHM_COMMON_BASE_EVENT_LOOP_H_
#define TENSORSHM_COMMON_BASE_EVENT_LOOP_H_

#include <sys/epoll.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/mutex.h"
#include "common/base/unique_fd.h"

namespace tensorshm {

class EventLoop {
 public:
  // Called on the loop's thread with the events epoll reported (EPOLLIN, EPOLLRDHUP, ...).
  using Callback = std::function<void(uint32_t events)>;

  // A loop watching nothing yet. `name` names it in errors ("memory channel"). Errors:
  // epoll_create1's or eventfd's.
  static absl::StatusOr<std::unique_ptr<EventLoop>> Create(absl::string_view name);
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Watches `fd` (borrowed: it stays open until Unwatch, or until the loop is gone) for
  // `events`, which may include EPOLLET (edge-triggered) and EPOLLRDHUP; `callback` is called for
  // each report. Errors: epoll_ctl's (EEXIST: `fd` is already watched); nothing is watched then.
  absl::Status Watch(int fd, uint32_t events, Callback callback) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops watching `fd`: its callback is not called again, not even for reports of the batch
  // being dispatched (a callback may unwatch its own descriptor, or another). A descriptor not
  // watched is ignored.
  void Unwatch(int fd) ABSL_LOCKS_EXCLUDED(mu_);

  // Waits up to `timeout_ms` (-1: until something comes; 0: not at all) and calls the callbacks
  // of what came, in epoll's order. Returns how many reports came (a Wake() counts as one), 0
  // when none came in time or a signal interrupted the wait. Once stopped(), returns at once,
  // calling no callback. Errors: epoll_wait's.
  absl::StatusOr<int> Poll(int timeout_ms) ABSL_LOCKS_EXCLUDED(mu_);

  // Makes the Poll() now waiting (or the next) return. One write to the eventfd.
  void Wake();
  // Makes stopped() true and wakes the loop: from then on Poll() calls no callback.
  void Stop();
  bool stopped() const { return stopped_.load(std::memory_order_acquire); }

 private:
  struct Watcher {
    uint32_t generation;
    std::unique_ptr<Callback> callback;
  };
  EventLoop(std::string name, UniqueFd epoll, UniqueFd wake)
      : name_(std::move(name)), epoll_(std::move(epoll)), wake_(std::move(wake)) {}

  const std::string name_;
  const UniqueFd epoll_;
  const UniqueFd wake_;  // an eventfd, watched with kWakeKey
  std::atomic<bool> stopped_{false};
  mutable Mutex mu_;
  // Each watched descriptor's callback and the generation its epoll reports carry (the upper
  // half of epoll_event.data.u64; the descriptor is the lower), so that a report for a
  // descriptor unwatched, closed and watched again in the same batch is not misdelivered.
  std::unordered_map<int, Watcher> watchers_ ABSL_GUARDED_BY(mu_);
  uint32_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  // Callbacks unwatched while a batch is dispatched (one of them may be running): freed once the
  // batch is done.
  std::vector<std::unique_ptr<Callback>> retired_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> retired_pending_{false};  // retired_ is not empty
};

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_BASE_EVENT_LOOP_H_
