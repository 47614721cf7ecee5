// CreateQueue: the creates that wait for memory (CreateOrder.wait_ms). When the pool cannot hold
// the buffer, the create (a CreateWait) waits on a first-come-first-served queue per PoolKey, is
// tried again whenever memory may have come free (the Store asks RetryDue as its lock goes: the
// catalog's release epoch moved), and is answered by success, its deadline, its cancellation or
// settle, its session's end or the Store's shutdown. No thread waits with it.
#ifndef TENSORSHM_SERVER_CORE_CREATE_QUEUE_H_
#define TENSORSHM_SERVER_CORE_CREATE_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "server/catalog/catalog.h"
#include "server/core/answers.h"
#include "server/core/creator.h"
#include "server/core/growth_queue.h"
#include "server/core/leasing.h"
#include "server/core/session.h"
#include "server/core/wait_queue.h"
#include "server/core/waiters.h"
#include "server/ops/metrics.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {

// Thread-compatible: the Store's lock guards it and everything it refers to; its answers go to
// `answers`, answered once that lock is released.
class CreateQueue {
 public:
  // All outlive it. `deadline_moved` is signalled when the earliest deadline moves closer (the
  // timer sleeps until it). `cross_cancel_hold`: StoreTestHooks::cross_cancel_hold.
  CreateQueue(Catalog& catalog, SessionTable& sessions, Creator& creator, Leasing& leasing,
              UidLimits& uid_limits, Metrics& metrics, Answers& answers, GrowthQueue& growth,
              CondVar& deadline_moved, absl::Duration cross_cancel_hold);
  CreateQueue(const CreateQueue&) = delete;
  CreateQueue& operator=(const CreateQueue&) = delete;

  // A create of `session` with wait_ms != 0 (waiter->deadline set): answered now (returned; OK:
  // the answer is in waiter->created), or `*answered_later`: queued for the grower or for memory.
  // `stopping`: the Store is shutting down (no new wait).
  absl::Status Wait(Session& session, CreateWait* waiter, bool stopping, bool* answered_later);
  // The grower's answer `grown` to `waiter` (its create in waiter->created when OK): answered, or
  // queued for memory if its pool was full (`pool_full`) and it may still wait.
  void FinishGrown(CreateWait* waiter, const absl::Status& grown, bool pool_full, bool stopping);
  // A settle of call `request_id` of session `session_id`: answers its waiting create CANCELLED
  // (true), if one waits.
  bool Settle(uint64_t session_id, uint64_t request_id);
  // A waiting create's cancellation: CANCELLED, unless it was answered already.
  void Cancel(CreateWait* waiter);
  // The transport is done with `waiter` (`cancelled`: its call failed before the client had the
  // answer): a create that succeeded but whose client gave up frees its buffers.
  void Done(CreateWait* waiter, bool cancelled);
  // Answers the waiting creates whose deadline is not after `now` (RESOURCE_EXHAUSTED); true if
  // any.
  bool Expire(absl::Time now);
  // Answers the waiting creates of session `session_id` (ending), or all of them, with `status`.
  void FailSession(uint64_t session_id, const absl::Status& status);
  void FailAll(const absl::Status& status);

  // Whether memory may have come free for the waiting creates since the last Retry (the
  // catalog's release epoch moved, a create left the queue, a segment grew).
  bool RetryDue() const {
    return !waiting_.empty() && (retry_ || catalog_.release_epoch() != retried_epoch_);
  }
  // Tries the waiting creates again, in order; once one for a PoolKey still does not fit, the
  // later ones for that key wait on (first come, first served). Answers those that are done.
  void Retry();
  // A pool grew ahead of need: the next RetryDue is true.
  void RoomAdded() { retry_ = true; }

  // RESOURCE_EXHAUSTED if creates wait for the memory of `key` (a new create queues behind
  // them); OK otherwise.
  absl::Status Blocking(const PoolKey& key) const;
  bool empty() const { return waiting_.empty(); }
  size_t size() const { return waiting_.size(); }
  absl::Time NextDeadline() const { return waiting_.NextDeadline(); }

 private:
  // Queues `waiter` of `session` (whose create found its pool full with `refusal`), charged to
  // its uid's --uid-waiters; an error refuses the wait and queues nothing.
  absl::Status Add(CreateWait* waiter, const Session& session, const absl::Status& refusal);
  void Remove(CreateWait* waiter);
  // Queues `waiter`, off the queue, to be answered with `status`, and counts its answer.
  void Finish(CreateWait* waiter, absl::Status status);
  // Records `created` as `waiter`'s answer, kept for a settle of `session`.
  void Served(CreateWait* waiter, Session& session, Created created);
  // "cpu pool: U of C bytes used" for `key`'s pool.
  std::string PoolUsage(const PoolKey& key) const;

  Catalog& catalog_;
  SessionTable& sessions_;
  Creator& creator_;
  Leasing& leasing_;
  UidLimits& uid_limits_;
  Metrics& metrics_;
  Answers& answers_;
  GrowthQueue& growth_;
  CondVar& deadline_moved_;
  const absl::Duration cross_cancel_hold_;
  // Keyed by the memory each waits for, first come first served.
  WaitQueue<PoolKey, CreateWait> waiting_;
  // The catalog's release_epoch() at the last retry, and whether a waiting create left the queue
  // (or a segment grew) since: either makes RetryDue true.
  uint64_t retried_epoch_ = 0;
  bool retry_ = false;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_CREATE_QUEUE_H_
