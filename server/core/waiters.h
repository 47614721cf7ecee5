// What the Store answers later: the calls that wait (acquires waiting for a publish, creates
// waiting for memory or for a pool to grow), as the Store sees them. A transport implements
// PendingCall (and the two waits) over its own call objects.
#ifndef TENSORSHM_SERVER_CORE_WAITERS_H_
#define TENSORSHM_SERVER_CORE_WAITERS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/core/tensor_calls.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {

// The call metadata key that names a caller's session (its token); named in refusals.
inline constexpr char kSessionMetadataKey[] = "tensorshm-session";

// A call the Store answers later, once its lock is released: a waiting acquire, a create waiting
// for memory, a create waiting for a pool to grow. The transport implements Answer, which the
// Store calls exactly once, with no lock held (Answer may re-enter the Store). `granted`: an OK
// answer to a call with a request id (it carries a grant).
class PendingCall {
 public:
  virtual ~PendingCall() = default;
  virtual void Answer(absl::Status status, bool granted) = 0;
};

// An Acquire: answered at once when it can be, else kept in the Store's AcquireWaits until
// one of a publish of its name, its deadline, its cancellation (CancelWaiter), its session's end
// or shutdown takes it off (under the Store's lock, so exactly one does) and answers it. The
// transport owns it; it outlives its answer until the transport calls WaiterDone.
class AcquireWait : public PendingCall {
 public:
  explicit AcquireWait(AcquireOrder order)
      : name(std::move(order.name)), wait_ms(order.wait_ms), request_id(order.request_id) {}
  // Whether the caller gave up on the call (its cancellation).
  virtual bool Cancelled() const = 0;

  // The DEADLINE_EXCEEDED answer, as a waiter polling its deadline gave it.
  absl::Status Expired() const;

  const std::string name;
  const int64_t wait_ms;
  const uint64_t request_id;                     // AcquireOrder.request_id: 0 if none
  absl::Time deadline = absl::InfiniteFuture();  // set by the transport before Acquire
  absl::Time waiting_since;  // when it was listed (tensorshm_acquire_wait_seconds)
  // Counted against --uid-waiters while listed (UidLimits has its own lock).
  std::optional<UidLimits::WaitCharge> wait_charge;

  // Under the Store's lock (set by AcquireWaits).
  uint64_t session_id = 0;
  std::string token;
  LeaseGrant granted;  // the answer's lease, once granted (lease_id 0: none)
};

// The memory a create draws from: a pool, and on the host pool the uid (each uid's buffers take
// segments of their own). Waiting creates are served in order per key.
struct PoolKey {
  int32_t device_type = 0;
  int32_t device_id = 0;
  uint32_t uid = 0;  // 0 for CUDA pools
  bool operator<(const PoolKey& other) const {
    return std::tie(device_type, device_id, uid) <
           std::tie(other.device_type, other.device_id, other.uid);
  }
  bool operator==(const PoolKey& other) const {
    return device_type == other.device_type && device_id == other.device_id && uid == other.uid;
  }
  template <typename H>
  friend H AbslHashValue(H h, const PoolKey& key) {
    return H::combine(std::move(h), key.device_type, key.device_id, key.uid);
  }
};

// A create the Store may answer later (one whose pool must grow first): the order, and the
// answer once it is made. The transport owns it until the Store has answered it.
class CreateCall : public PendingCall {
 public:
  explicit CreateCall(CreateOrder order) : order(std::move(order)) {}

  const CreateOrder order;
  Created created;  // an OK answer's, written under the Store's lock before Answer
};

// A create with wait_ms != 0 (CreateOrder.wait_ms): when the pool cannot hold the buffer, it
// waits on a first-come-first-served queue, tried again whenever memory may have come free, and
// is answered by success, its deadline, its cancellation (CancelCreate), its session's end or
// BeginShutdown. The transport owns it until CreateWaiterDone.
class CreateWait : public CreateCall {
 public:
  explicit CreateWait(CreateOrder order) : CreateCall(std::move(order)), started(absl::Now()) {}
  // Whether the caller gave up on the call (its cancellation).
  virtual bool Cancelled() const = 0;

  // The answer once the wait is over: RESOURCE_EXHAUSTED with the last refusal, how long it
  // waited and the pool's usage now (`usage`).
  absl::Status Expired(const std::string& usage) const;

  const absl::Time started;
  absl::Time deadline = absl::InfiniteFuture();  // set by the transport before CreateWaiting
  // Counted against --uid-waiters while queued (UidLimits has its own lock).
  std::optional<UidLimits::WaitCharge> wait_charge;

  // Under the Store's lock.
  PoolKey key;
  uint64_t session_id = 0;
  std::string token;
  absl::Status refusal;               // the last RESOURCE_EXHAUSTED the create got
  std::vector<uint64_t> created_ids;  // the buffers the answer carried, once created
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_WAITERS_H_
