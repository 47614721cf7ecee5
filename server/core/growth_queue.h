// GrowthQueue: what the Store's GrowPools thread is to do, the one thread that makes pool segments
// once the daemon serves: the creates that wait for a pool to grow, first come first served, and
// the uids whose host segments are to grow ahead of need (HostPool::PlanAhead).
#ifndef TENSORSHM_SERVER_CORE_GROWTH_QUEUE_H_
#define TENSORSHM_SERVER_CORE_GROWTH_QUEUE_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "common/base/mutex.h"
#include "server/catalog/catalog.h"
#include "server/core/waiters.h"

namespace tensorshm {

// Thread-compatible: the Store's lock guards it; `wake()` is waited on with that lock.
class GrowthQueue {
 public:
  struct PendingCreate {
    CreateCall* call;              // its order, and where its answer goes
    std::string token;             // the caller's session
    CreateWait* waiter = nullptr;  // set when the create may wait for memory (it is `call`)
  };

  // `catalog` outlives it.
  explicit GrowthQueue(const Catalog& catalog) : catalog_(catalog) {}
  GrowthQueue(const GrowthQueue&) = delete;
  GrowthQueue& operator=(const GrowthQueue&) = delete;

  // Queues a create whose pool must grow first.
  void Push(PendingCreate create) {
    creates_.push_back(std::move(create));
    wake_.Signal();
  }
  // After an allocation in `uid`'s host segments: if the host pool plans growth ahead of need
  // for it, names it for the grower (not once stopped).
  void Ahead(uint32_t uid) {
    if (stopped_ || !catalog_.host_pool().PlanAhead(uid).has_value()) return;
    if (ahead_.insert(uid).second) wake_.Signal();
  }
  // No growth ahead from now on; the grower wakes to end.
  void Stop() {
    stopped_ = true;
    wake_.SignalAll();
  }

  bool has_creates() const { return !creates_.empty(); }
  bool has_ahead() const { return !ahead_.empty(); }
  // The earliest create queued. REQUIRES: has_creates().
  PendingCreate PopCreate() {
    PendingCreate create = std::move(creates_.front());
    creates_.pop_front();
    return create;
  }
  // A uid named by Ahead. REQUIRES: has_ahead().
  uint32_t PopAhead() { return ahead_.extract(ahead_.begin()).value(); }
  // Every create queued, taken (at shutdown).
  std::deque<PendingCreate> TakeCreates() { return std::exchange(creates_, {}); }

  // Signalled when a create or a growth ahead is queued, and on Stop.
  CondVar& wake() { return wake_; }

 private:
  const Catalog& catalog_;
  std::deque<PendingCreate> creates_;
  std::set<uint32_t> ahead_;
  bool stopped_ = false;
  CondVar wake_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_GROWTH_QUEUE_H_
