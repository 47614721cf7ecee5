// Creator: a session's create, as every transport and every retry makes it: the quotas first,
// then the pool (what lease pages let go of, eviction under --evict lru), the buffers stocked
// ahead of the session's need, and growth of the host pool ahead of it.
#ifndef TENSORSHM_SERVER_CORE_CREATOR_H_
#define TENSORSHM_SERVER_CORE_CREATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/catalog/catalog.h"
#include "server/core/growth_queue.h"
#include "server/core/leasing.h"
#include "server/core/session.h"
#include "server/core/tensor_calls.h"
#include "server/core/waiters.h"
#include "server/ops/eviction.h"
#include "server/ops/metrics.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {

class CreateQueue;

// Thread-compatible: the Store's lock guards it and everything it refers to.
class Creator {
 public:
  // All outlive it. `queue`: the creates waiting for memory, which a new create queues behind.
  // `session_quota_bytes`: --session-quota (0: none).
  Creator(Catalog& catalog, Leasing& leasing, const UidLimits& uid_limits, Metrics& metrics,
          const CreateQueue& queue, GrowthQueue& growth, uint64_t session_quota_bytes);
  Creator(const Creator&) = delete;
  Creator& operator=(const Creator&) = delete;

  // --evict: what a create that finds its pool full may do first. Set before serving.
  void set_evict_policy(EvictPolicy policy) { evict_ = policy; }
  EvictPolicy evict_policy() const { return evict_; }

  // A create for `session`. A create that needs a new pool segment fails with `growth` saying so
  // (see SegmentGrowth), to be made by the grower. A create that finds its pool (or the record
  // table) full, or creates waiting for that memory ahead of it (unless `waited`: it is one of
  // them), returns RESOURCE_EXHAUSTED and sets `*pool_full` (if given): it may wait. Quota
  // refusals do not set it.
  absl::StatusOr<Created> Create(Session& session, const CreateOrder& order, SegmentGrowth* growth,
                                 bool waited = false, bool* pool_full = nullptr);
  // Makes up to `count` unpublished uint8 buffers of `length` bytes for `session` ahead of its
  // need (CreateOrder.stock, PublishOrder.stock), fewer when the pool is short; none under a
  // quota. Stock never grows a pool: it takes what the segments made so far hold.
  std::vector<Stocked> Stock(Session& session, uint64_t length, uint32_t count);

  // The device `order` names, its uuid (if any) resolved to the daemon's ordinal:
  // INVALID_ARGUMENT or FAILED_PRECONDITION (CudaOrdinalOf) if it names none.
  absl::StatusOr<DLDevice> DeviceOf(const CreateOrder& order) const;
  // The memory a create on `device` by `session` draws from.
  static PoolKey KeyOf(const Session& session, const DLDevice& device) {
    return PoolKey{device.device_type, device.device_id,
                   device.device_type == kDLCPU ? session.uid : 0};
  }

 private:
  // The daemon's ordinal of the CUDA device with `uuid`. INVALID_ARGUMENT unless `device` is
  // CUDA and `uuid` 16 bytes, FAILED_PRECONDITION if no pool is on that device.
  absl::StatusOr<int> CudaOrdinalOf(const DLDevice& device, const std::string& uuid) const;
  // RESOURCE_EXHAUSTED naming the limit and its flag if a buffer for `spec` on `device` would
  // take `session` past --session-quota or its uid past --uid-quota; OK otherwise, and when the
  // layout is invalid (Catalog::Create says why). Takes and counts nothing.
  absl::Status CheckQuotas(Session& session, const TensorSpec& spec, const DLDevice& device);

  Catalog& catalog_;
  Leasing& leasing_;
  const UidLimits& uid_limits_;
  Metrics& metrics_;
  const CreateQueue& queue_;
  GrowthQueue& growth_;
  const uint64_t session_quota_bytes_;
  EvictPolicy evict_ = EvictPolicy::kNone;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_CREATOR_H_
