#include "client/cancel.h"

#include "client/fast_path.h"
#include "tensorshm/client.h"

namespace tensorshm {

bool CancelState::Add(Wait* wait) {
  MutexLock lock(&mu_);
  if (cancelled_) return false;
  waits_.insert(wait);
  return true;
}

void CancelState::Remove(Wait* wait) {
  MutexLock lock(&mu_);
  waits_.erase(wait);
}

void CancelState::Cancel() {
  MutexLock lock(&mu_);
  cancelled_ = true;
  // Under the lock: a registered wait's context and fast path live until it is removed.
  for (Wait* wait : waits_) {
    if (wait->context != nullptr) wait->context->TryCancel();
    if (wait->fast != nullptr) wait->fast->WakePublishWaiters();
    if (wait->call) wait->call();
  }
}

bool CancelState::cancelled() const {
  MutexLock lock(&mu_);
  return cancelled_;
}

WaitCanceller::WaitCanceller() : state_(std::make_shared<CancelState>()) {}

void WaitCanceller::Cancel() const { state_->Cancel(); }

bool WaitCanceller::cancelled() const { return state_->cancelled(); }

}  // namespace tensorshm
