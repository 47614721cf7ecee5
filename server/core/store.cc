// The Store's frame (its parts, Admit, the lock, the caller's session), its housekeeping, and
// the calls on names: Publish, Delete, List, Stat. The rest of the Store lives in
// store_create.cc (creates), store_growth.cc (GrowPools), store_acquire.cc (acquires, shutdown,
// the waiters' timer), store_sessions.cc (sessions) and store_channel.cc (the memory channel's
// requests); the work itself is its parts' (see store.h).
#include "server/core/store.h"

#include <cstring>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "common/tensor/layout.h"
#include "common/tensor/name.h"
#include "server/ops/log.h"

namespace tensorshm {
namespace {

// Records the housekeeping thread compares with the catalog's own copies each round (every
// kHeartbeatIntervalNs): a table of 65,536 records in under 3 s, some tens of microseconds a round.
constexpr size_t kRecordsCheckedPerRound = 256;

}  // namespace

Store::Store(std::unique_ptr<Catalog> catalog, uint64_t session_quota_bytes,
             const AccessPolicy* policy, const PeerTable* peers, const UidLimitsConfig& uid_limits,
             const StoreTestHooks& test_hooks)
    : index_(catalog->mutable_index()),
      cross_cancel_hold_(test_hooks.cross_cancel_hold),
      growth_delay_(test_hooks.growth_delay),
      catalog_(std::move(catalog)),
      policy_(policy),
      peers_(peers),
      uid_limits_(uid_limits),
      leasing_(*catalog_, sessions_),
      acquire_waits_(*catalog_, sessions_, leasing_, uid_limits_, metrics_, answers_,
                     next_deadline_, cross_cancel_hold_),
      growth_(*catalog_),
      creator_(*catalog_, leasing_, uid_limits_, metrics_, create_queue_, growth_,
               session_quota_bytes),
      create_queue_(*catalog_, sessions_, creator_, leasing_, uid_limits_, metrics_, answers_,
                    growth_, next_deadline_, cross_cancel_hold_),
      session_desk_(*catalog_, sessions_, leasing_, acquire_waits_, create_queue_, uid_limits_,
                    metrics_, policy),
      publisher_(*catalog_, leasing_, acquire_waits_, creator_, growth_, policy),
      channel_(*catalog_, sessions_, creator_, create_queue_, acquire_waits_, session_desk_,
               publisher_,
               /*offer_fast_path=*/cross_cancel_hold_ == absl::ZeroDuration()) {
  // The host pool is shared evenly between the uids creating tensors (HostPool::FairShare).
  catalog_->mutable_host_pool().set_creating_uids([this] { return uid_limits_.CreatingUids(); });
  // Tensor records outlive sessions: the catalog counts them per uid (--uid-tensors).
  catalog_->set_uid_tensors(uid_limits.tensors);
  // Lease page slots count against --uid-leases with the RPC leases (see LeaseBoard).
  catalog_->CountPageLeasesIn(&uid_limits_);
}

Store::~Store() {
  // uid_limits_ goes before catalog_, whose lease pages may still count slots in it.
  catalog_->CountPageLeasesIn(nullptr);
}

int Store::ExpireUnbound() {
  Lock lock(this);
  return catalog_->ExpireUnbound();
}

void Store::KeepHeldOnStop() {
  Lock lock(this);
  keep_held_on_stop_ = true;
}

void Store::KeepSegments() {
  Lock lock(this);
  catalog_->KeepSegments();
}

absl::StatusOr<PeerCredentials> Store::Admit(const std::string& peer_address) const {
  if (policy_ == nullptr || peers_ == nullptr) return PeerCredentials{};
  absl::StatusOr<PeerCredentials> peer = peers_->Find(peer_address);
  if (!peer.ok()) {
    return absl::PermissionDeniedError(
        absl::StrCat("connection ", peer_address, ": peer credentials unknown"));
  }
  if (absl::Status s = policy_->Admit(*peer); !s.ok()) return s;
  return *peer;
}

void Store::Housekeep() {
  while (true) {
    // The heartbeat does not wait for the mutex: a long call (a segment growing) must not make
    // clients take the daemon for dead.
    index_.Heartbeat();
    Lock lock(this);
    if (shutting_down_) return;
    catalog_->ReadLeasePages();
    catalog_->Reclaim();
    // --evict lru learns of fast path acquires from the lease pages (Catalog::TouchHeld).
    if (creator_.evict_policy() == EvictPolicy::kLru) catalog_->TouchHeld();
    FoldFastAcquires();
    catalog_->CheckRecords(kRecordsCheckedPerRound);
    stopping_.WaitWithTimeout(&mu_, absl::Nanoseconds(kHeartbeatIntervalNs));
    if (shutting_down_) return;
  }
}

void Store::FoldFastAcquires() {
  const uint64_t total = catalog_->FastAcquires();
  // The board's total never decreases.
  TSM_CHECK(total >= fast_acquires_counted_);
  metrics_.CountFastAcquires(total - fast_acquires_counted_);
  fast_acquires_counted_ = total;
}

absl::StatusOr<Session*> Store::CallerSession(const std::optional<std::string>& token,
                                              const PeerCredentials& caller) {
  if (!token.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata ", kSessionMetadataKey, ": missing; open a Session stream and send its id"));
  }
  tensorshm::Session* session = sessions_.Find(*token);
  if (session == nullptr) return NoSessionError(*token);
  if (absl::Status s = session->CheckCaller(caller); !s.ok()) return s;
  return session;
}

absl::StatusOr<Published> Store::Publish(const PeerCredentials& peer,
                                         const std::optional<std::string>& token,
                                         const PublishOrder& order) {
  Lock lock(this);
  absl::StatusOr<tensorshm::Session*> session = CallerSession(token, peer);
  if (!session.ok()) return session.status();
  return publisher_.Publish(**session, order);
}

absl::Status Store::Delete(const PeerCredentials& peer, const std::optional<std::string>& token,
                           const std::string& name) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  Lock lock(this);
  absl::StatusOr<tensorshm::Session*> session = CallerSession(token, peer);
  if (!session.ok()) return session.status();
  return publisher_.Delete(**session, name);
}

absl::StatusOr<std::vector<TensorListing>> Store::List(const PeerCredentials& caller,
                                                       const std::string& prefix) {
  if (absl::Status s = ValidateNamePrefix(prefix); !s.ok()) return s;
  Lock lock(this);
  return publisher_.List(caller, prefix);
}

StoreFigures Store::StatSnapshot() {
  Lock lock(this);
  return StatLocked();
}

StoreFigures Store::StatLocked() {
  FoldFastAcquires();
  catalog_->ReadLeasePages();
  StoreFigures figures;
  figures.tensors = catalog_->tensor_count();
  figures.names = catalog_->name_count();
  figures.leases = sessions_.lease_count() + catalog_->PageLeaseCount();
  figures.sessions = sessions_.size();
  figures.evicted_tensors = catalog_->evicted_tensors();
  figures.evicted_bytes = catalog_->evicted_bytes();
  figures.creates_waiting = static_cast<int64_t>(create_queue_.size());
  figures.stocked_tensors = catalog_->stocked_tensors();
  const HostPool& pool = catalog_->host_pool();
  figures.pools.push_back(PoolFigures{
      .device = DLDevice{kDLCPU, 0},
      .capacity_bytes = static_cast<int64_t>(pool.capacity_bytes()),
      // Stock is allocated from the pool like any buffer: the pool's own figure holds both.
      .used_bytes = static_cast<int64_t>(pool.used_bytes() - catalog_->stock_bytes()),
      .stock_bytes = static_cast<int64_t>(catalog_->stock_bytes()),
      .segments = static_cast<int64_t>(pool.live_segment_count()),
      .largest_free_bytes = static_cast<int64_t>(pool.largest_free_bytes()),
  });
  for (const CudaPool* cuda : catalog_->cuda_pools()) {
    figures.pools.push_back(PoolFigures{
        .device = DLDevice{kDLCUDA, cuda->ordinal()},
        .capacity_bytes = static_cast<int64_t>(cuda->capacity_bytes()),
        .used_bytes = static_cast<int64_t>(cuda->used_bytes()),
        .segments = static_cast<int64_t>(cuda->segment_count()),
        .largest_free_bytes = static_cast<int64_t>(cuda->largest_free_bytes()),
    });
  }
  // Eviction (--evict lru) adds its figures here; metrics.cc exports them.
  return figures;
}

}  // namespace tensorshm
