// AcquireWaits: the acquires that wait for a publish of their name. Each is answered exactly once:
// by a publish (with a lease), its deadline, its cancellation or settle, its session's end, or
// the Store's shutdown. No thread waits with it: the Store's timer thread calls Expire.
#ifndef TENSORSHM_SERVER_CORE_ACQUIRE_WAITS_H_
#define TENSORSHM_SERVER_CORE_ACQUIRE_WAITS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "server/catalog/catalog.h"
#include "server/core/answers.h"
#include "server/core/leasing.h"
#include "server/core/session.h"
#include "server/core/wait_queue.h"
#include "server/core/waiters.h"
#include "server/ops/metrics.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {

// Thread-compatible: the Store's lock guards it and everything it refers to; its answers go to
// `answers`, answered once that lock is released.
class AcquireWaits {
 public:
  // All outlive it. `deadline_moved` is signalled when the earliest deadline moves closer (the
  // timer sleeps until it). `cross_cancel_hold`: StoreTestHooks::cross_cancel_hold.
  AcquireWaits(Catalog& catalog, SessionTable& sessions, Leasing& leasing, UidLimits& uid_limits,
               Metrics& metrics, Answers& answers, CondVar& deadline_moved,
               absl::Duration cross_cancel_hold);
  AcquireWaits(const AcquireWaits&) = delete;
  AcquireWaits& operator=(const AcquireWaits&) = delete;

  // An Acquire of `session` (waiter->deadline set): answered now (returned: a lease in
  // waiter->granted, or a refusal), or listed and `*answered_later`. `stopping`: the Store is
  // shutting down (no new wait).
  absl::Status Acquire(Session& session, AcquireWait* waiter, bool stopping, bool* answered_later);
  // Gives every waiter for `name` (just published) a lease on it, and answers it.
  void Wake(const std::string& name);
  // Answers every waiter of session `session_id` (ending) with `status`.
  void FailSession(uint64_t session_id, const absl::Status& status);
  // Answers every waiter with `status` (the Store's shutdown).
  void FailAll(const absl::Status& status);
  // A settle of call `request_id` of session `session_id`: answers its waiting acquire CANCELLED
  // (true), if one waits.
  bool Settle(uint64_t session_id, uint64_t request_id);
  // A waiter's cancellation: CANCELLED, unless it was answered already.
  void Cancel(AcquireWait* waiter);
  // The transport is done with `waiter` (`cancelled`: its call failed before the client had the
  // answer): drops the lease the answer carried, if any.
  void Done(AcquireWait* waiter, bool cancelled);
  // Answers the waiters whose deadline is not after `now` (DEADLINE_EXCEEDED); true if any.
  bool Expire(absl::Time now);

  // The earliest deadline of a waiter (absl::InfiniteFuture() if none).
  absl::Time NextDeadline() const { return waiting_.NextDeadline(); }
  size_t CountOfSession(uint64_t session_id) const { return waiting_.CountOfSession(session_id); }

 private:
  // Lists `waiter` of `session` under its name, its session and (finite) its deadline, charged
  // to its uid's --uid-waiters; an error refuses the wait and lists nothing.
  absl::Status Add(AcquireWait* waiter, const Session& session);
  void Remove(AcquireWait* waiter);
  // Queues `waiter`, off the lists, to be answered with `status`, and counts its answer.
  void Finish(AcquireWait* waiter, absl::Status status);

  Catalog& catalog_;
  SessionTable& sessions_;
  Leasing& leasing_;
  UidLimits& uid_limits_;
  Metrics& metrics_;
  Answers& answers_;
  CondVar& deadline_moved_;
  const absl::Duration cross_cancel_hold_;
  WaitQueue<std::string, AcquireWait> waiting_;  // keyed by the name each waits for
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_ACQUIRE_WAITS_H_
