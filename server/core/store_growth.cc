// GrowPools: the one thread that makes pool segments once the Store serves, for the creates that
// need one (gRPC's, and the memory channel's sent to gRPC) and ahead of need; every growth runs
// with mu_ released (GrowUnlocked), so no call and no channel waits for it.
#include <optional>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "server/core/store.h"
#include "server/ops/log.h"

namespace tensorshm {

void Store::GrowPools() {
  while (true) {
    Lock lock(this);
    // Between growths, the segments of uids that have gone are given back (looked for once a
    // second: a uid's last session may have ended).
    while (!growth_.has_creates() && !growth_.has_ahead() && !shutting_down_ &&
           !catalog_->host_pool().HasIdleSegments()) {
      growth_.wake().WaitWithTimeout(&mu_, absl::Seconds(1));
    }
    if (shutting_down_) {
      for (const GrowthQueue::PendingCreate& create : growth_.TakeCreates()) {
        metrics_.CountOp(MetricOp::kCreate, absl::StatusCode::kUnavailable);
        answers_.Later(create.call, absl::UnavailableError("tensorshmd is stopping"));
      }
      return;
    }
    if (!growth_.has_creates()) {
      if (growth_.has_ahead()) {
        GrowAheadNow(growth_.PopAhead());  // nothing waits for a segment now: grow ahead of need
      } else {
        GiveBackIdleSegments();
      }
      continue;
    }
    const GrowthQueue::PendingCreate create = growth_.PopCreate();
    const absl::Status gone = NoSessionError(create.token);
    bool pool_full = false;
    absl::StatusOr<Created> created =
        CreateGrowing(create.token, gone, create.call->order, &pool_full);
    absl::Status status = created.status();
    if (created.ok()) create.call->created = *std::move(created);
    if (create.waiter != nullptr) {
      // Counted when it is answered.
      create_queue_.FinishGrown(create.waiter, status, pool_full, shutting_down_);
    } else {
      const uint64_t request_id = create.call->order.request_id;
      if (status.ok()) {
        status = leasing_.KeepCreated(create.token, gone, request_id, create.call->created);
      }
      metrics_.CountOp(MetricOp::kCreate, status);
      answers_.Later(create.call, status, status.ok() && request_id != 0);
    }
  }  // `lock` goes: the create is answered
}

absl::StatusOr<Created> Store::CreateGrowing(const std::string& token, const absl::Status& gone,
                                             const CreateOrder& order, bool* pool_full) {
  while (true) {
    tensorshm::Session* session = sessions_.Find(token);
    if (session == nullptr) return gone;
    SegmentGrowth growth;
    absl::StatusOr<Created> created =
        creator_.Create(*session, order, &growth, /*waited=*/false, pool_full);
    if (growth.busy()) {
      // Another call is making a segment of that pool: it may be the one this create needs.
      grown_.Wait(&mu_);
      continue;
    }
    if (!growth.needed()) return created;
    const absl::Status grown = GrowUnlocked(growth);
    if (absl::IsResourceExhausted(grown)) metrics_.CountAllocationFailure(AllocationFailure::kPool);
    if (!grown.ok()) return grown;
  }
}

absl::Status Store::GrowUnlocked(SegmentGrowth& growth) {
  // Making a segment reserves all its memory (posix_fallocate, cuMemAlloc): every other call
  // goes on meanwhile.
  catalog_->BeginGrowth(growth);
  UnlockAndFinish();
  if (growth_delay_ > absl::ZeroDuration()) {
    TSM_LOG(kWarning) << "TENSORSHMD_TEST_GROWTH_DELAY_MS: a pool growth sleeps "
                      << absl::FormatDuration(growth_delay_) << " before it makes its segment";
    absl::SleepFor(growth_delay_);
  }
  growth.Make();
  mu_.lock();
  const absl::Status grown = catalog_->EndGrowth(growth);
  grown_.SignalAll();
  return grown;
}

void Store::GiveBackIdleSegments() {
  std::vector<ShmSegment> idle = catalog_->mutable_host_pool().GiveBackIdle();
  // Emptying them takes a while (their pages punched out): every other call goes on meanwhile.
  UnlockAndFinish();
  HostPool::DisposeSegments(std::move(idle));
  mu_.lock();
}

void Store::GrowAheadNow(uint32_t uid) {
  std::optional<GrowthRequest> plan = catalog_->host_pool().PlanAhead(uid);
  if (!plan.has_value()) return;  // grown meanwhile, or room was freed or taken
  SegmentGrowth growth;
  growth.cuda_ordinal = -1;
  growth.request = *plan;
  const absl::Status grown = GrowUnlocked(growth);
  if (grown.ok()) {
    create_queue_.RoomAdded();  // a waiting create of that uid may fit now
    return;
  }
  // Creates still grow the pool on demand; an operator hears of this once (e.g. /dev/shm full).
  if (!warned_growth_ahead_) {
    warned_growth_ahead_ = true;
    TSM_LOG(kWarning) << "host pool: growing segment " << plan->segment_id << " (" << plan->size
                      << " bytes) ahead of need for uid " << uid << " failed: " << grown
                      << "; creates will grow the pool as they need it "
                      << "(logged once)";
  }
}

}  // namespace tensorshm
