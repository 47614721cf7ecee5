// What a WaitCanceller shares between its copies: whether it was cancelled, and the waits it can
// reach now (a gRPC call's context, or a fast path's futex word). Private to the client library.
#ifndef TENSORSHM_CLIENT_CANCEL_H_
#define TENSORSHM_CLIENT_CANCEL_H_

#include <grpcpp/client_context.h>

#include <functional>
#include <set>

#include "absl/base/thread_annotations.h"
#include "common/base/mutex.h"

namespace tensorshm {

class FastPath;

class CancelState {
 public:
  // A wait in progress, registered while it may block. Exactly one of the three is set.
  struct Wait {
    grpc::ClientContext* context = nullptr;  // a waiting RPC: Cancel TryCancel()s it
    const FastPath* fast = nullptr;          // a fast path wait: Cancel wakes its futex word
    // Anything else (a memory channel request): Cancel calls it, under this state's lock.
    std::function<void()> call{};
  };

  // Registers `wait` until Remove; false (nothing registered) if already cancelled.
  bool Add(Wait* wait) ABSL_LOCKS_EXCLUDED(mu_);
  void Remove(Wait* wait) ABSL_LOCKS_EXCLUDED(mu_);
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  bool cancelled() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::set<Wait*> waits_ ABSL_GUARDED_BY(mu_);
};

// Registers a wait with a CancelState (which may be null: nothing to register) for its scope.
class ScopedWait {
 public:
  ScopedWait(CancelState* state, CancelState::Wait wait) : state_(state), wait_(wait) {
    registered_ = state_ == nullptr || state_->Add(&wait_);
  }
  ~ScopedWait() {
    if (state_ != nullptr && registered_) state_->Remove(&wait_);
  }
  ScopedWait(const ScopedWait&) = delete;
  ScopedWait& operator=(const ScopedWait&) = delete;
  // False if the state was cancelled before the wait began: do not wait.
  bool registered() const { return registered_; }

 private:
  CancelState* const state_;
  CancelState::Wait wait_;
  bool registered_ = false;
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_CANCEL_H_
