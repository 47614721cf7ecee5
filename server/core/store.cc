// The Store's frame (Admit, the lock, the caller's session), its housekeeping, and the calls on
// published tensors: Publish, Delete, List, Stat. The rest of the Store lives in
// store_create.cc (Create), store_create_waiters.cc (creates that wait for memory),
// store_growth.cc (GrowPools), store_acquire.cc (waiting acquires, shutdown),
// store_sessions.cc (sessions) and store_channel.cc (the memory channel's requests).
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
      grants_(*catalog_, /*offer_fast_path=*/cross_cancel_hold_ == absl::ZeroDuration()),
      session_quota_bytes_(session_quota_bytes),
      policy_(policy),
      peers_(peers),
      uid_limits_(uid_limits) {
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

absl::Status Store::MayChange(const tensorshm::Session& session, const Tensor& tensor,
                              absl::string_view verb) const {
  if (policy_ == nullptr || session.uid == tensor.owner_uid || session.uid == policy_->owner()) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "name = \"", tensor.name, "\": published by uid ", tensor.owner_uid, "; uid ", session.uid,
      " may not ", verb, " it (only its publisher and the daemon's uid may)"));
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
    if (evict_ == EvictPolicy::kLru) catalog_->TouchHeld();
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

absl::Status Store::NoSession(const std::string& token) {
  return absl::FailedPreconditionError(
      absl::StrCat("metadata ", kSessionMetadataKey, " = \"", absl::CHexEscape(token.substr(0, 64)),
                   "\": no open session has this id (its stream ended, or it never existed)"));
}

absl::StatusOr<Session*> Store::CallerSession(const std::optional<std::string>& token,
                                              const PeerCredentials& caller) {
  if (!token.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata ", kSessionMetadataKey, ": missing; open a Session stream and send its id"));
  }
  tensorshm::Session* session = sessions_.Find(*token);
  if (session == nullptr) return NoSession(*token);
  if (absl::Status s = session->CheckCaller(caller); !s.ok()) return s;
  return session;
}

DecodedTensor Store::DescriptionOf(const Tensor& tensor) {
  return DecodedTensor{
      .dtype = tensor.dtype,
      .device = tensor.device,
      .shape = tensor.shape,
      .strides = tensor.strides,
      .byte_offset = tensor.byte_offset,
      .nbytes = tensor.nbytes,
      .flags = tensor.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : uint64_t{0}};
}

TensorPlace Store::PlaceOf(const Tensor& tensor) const {
  TensorPlace place{.segment_id = tensor.buffer.segment_id,
                    .offset = tensor.buffer.offset,
                    .length = tensor.buffer.length,
                    // CUDA segments are always this daemon's own (device memory does not survive
                    // it).
                    .segment_instance = catalog_->instance_id()};
  if (tensor.device.device_type == kDLCUDA) {
    const CudaPool* pool = catalog_->cuda_pool(tensor.device.device_id);
    CudaPlace& cuda = place.cuda.emplace();
    cuda.ordinal = pool->ordinal();
    cuda.uuid.assign(reinterpret_cast<const char*>(pool->uuid().data()), pool->uuid().size());
    if (tensor.buffer.length > 0) {
      place.segment_size = pool->SegmentSize(tensor.buffer.segment_id);
      if (pool->kind() == CudaPoolKind::kVmm) {
        cuda.vmm = true;  // its descriptor comes over the memory channel
      } else {
        const CUipcMemHandle& handle = pool->SegmentHandle(tensor.buffer.segment_id);
        cuda.ipc_handle.assign(handle.reserved, sizeof(handle.reserved));
      }
    }
    if (tensor.sealed) cuda.ready_event = tensor.ready_event;
  } else if (tensor.buffer.length > 0) {
    const HostPool& pool = catalog_->host_pool();
    place.segment_size = pool.SegmentSize(tensor.buffer.segment_id);
    place.segment_instance = pool.SegmentInstance(tensor.buffer.segment_id);
    // Each segment's own backing: a pool of named segments gives other uids memfd ones.
    const ShmSegment& segment = pool.Segment(tensor.buffer.segment_id);
    place.shm_name = segment.backing() == SegmentBacking::kNamed ? segment.name() : "";
  }
  return place;
}

LeaseGrant Store::Grant(tensorshm::Session& session, const Tensor& tensor) {
  return LeaseGrant{.lease_id = AddLease(session, tensor),
                    .tensor_id = tensor.id,
                    .desc = DescriptionOf(tensor),
                    .place = PlaceOf(tensor)};
}

uint64_t Store::AddLease(tensorshm::Session& session, const Tensor& tensor) {
  const uint64_t lease = sessions_.NextLeaseId();
  session.leases.emplace(lease, tensor.id);
  catalog_->AddLease(tensor.id);
  return lease;
}

absl::StatusOr<Published> Store::Publish(const PeerCredentials& peer,
                                         const std::optional<std::string>& token,
                                         const PublishOrder& order) {
  Lock lock(this);
  absl::StatusOr<tensorshm::Session*> session = CallerSession(token, peer);
  if (!session.ok()) return session.status();
  return PublishFor(**session, order);
}

absl::StatusOr<Published> Store::PublishFor(tensorshm::Session& session,
                                            const PublishOrder& order) {
  if (absl::Status s = ValidateName(order.name); !s.ok()) return s;
  if (const Tensor* bound = catalog_->Find(order.name); bound != nullptr && order.replace) {
    if (absl::Status s = MayChange(session, *bound, "replace"); !s.ok()) return s;
  }
  if (!order.ready_event.empty()) {
    const Tensor* tensor = catalog_->FindId(order.tensor_id);
    if (order.ready_event.size() != sizeof(CUipcEventHandle)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ready_event: ", order.ready_event.size(), " bytes; must be empty or a ",
                       sizeof(CUipcEventHandle), "-byte CUipcEventHandle"));
    }
    if (tensor != nullptr && tensor->device.device_type != kDLCUDA) {
      return absl::InvalidArgumentError(absl::StrCat("ready_event: set for tensor ", tensor->id,
                                                     " on ", DeviceName(tensor->device),
                                                     "; only CUDA tensors take one"));
    }
  }
  if (order.spec.has_value()) {
    const TensorSpec& spec = *order.spec;
    if (absl::Status s = catalog_->Reshape(session.id, order.tensor_id, spec.dtype, spec.shape,
                                           spec.strides, spec.subbyte_padded);
        !s.ok()) {
      return s;
    }
  }
  // The lease of publish-and-acquire is charged first: over --uid-leases nothing is published.
  if (order.acquire) {
    if (absl::Status s = session.uid_charge.AddLeases(); !s.ok()) return s;
  }
  absl::Status s = catalog_->Publish(session.id, order.tensor_id, order.name, order.replace,
                                     order.ready_event, session.pid);
  if (!s.ok()) {
    if (order.acquire) session.uid_charge.DropLeases();
    return s;
  }
  session.ForgetUnpublished(order.tensor_id);
  Published published;
  if (order.acquire) {
    const Tensor* tensor = catalog_->FindId(order.tensor_id);
    TSM_CHECK(tensor != nullptr);
    published.acquired = Grant(session, *tensor);
  }
  WakeWaiters(order.name);
  if (order.stock > 0) {
    published.stocked = Stock(session, order.stock_bytes, order.stock);
    GrowAhead(session.uid);
  }
  return published;
}

absl::Status Store::Delete(const PeerCredentials& peer, const std::optional<std::string>& token,
                           const std::string& name) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  Lock lock(this);
  absl::StatusOr<tensorshm::Session*> session = CallerSession(token, peer);
  if (!session.ok()) return session.status();
  return DeleteFor(**session, name);
}

absl::Status Store::DeleteFor(const tensorshm::Session& session, const std::string& name) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (const Tensor* bound = catalog_->Find(name); bound != nullptr) {
    if (absl::Status s = MayChange(session, *bound, "delete"); !s.ok()) return s;
  }
  return catalog_->Delete(name);
}

absl::StatusOr<std::vector<TensorListing>> Store::List(const PeerCredentials& caller,
                                                       const std::string& prefix) {
  if (absl::Status s = ValidateNamePrefix(prefix); !s.ok()) return s;
  Lock lock(this);
  catalog_->ReadLeasePages();  // once: each entry's page leases are then a look-up
  std::vector<TensorListing> listed;
  for (const Tensor* tensor : catalog_->List(prefix)) {
    TensorListing& entry = listed.emplace_back();
    entry.name = tensor->name;
    entry.tensor_id = tensor->id;
    entry.desc = DescriptionOf(*tensor);
    entry.leases = catalog_->LeaseCount(*tensor);
    entry.published_unix_ms = tensor->published_unix_ms;
    entry.publisher_uid = tensor->owner_uid;
    if (SeesDetailsOf(caller, tensor->owner_uid)) entry.publisher_pid = tensor->publisher_pid;
  }
  return listed;
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
  figures.creates_waiting = static_cast<int64_t>(creates_waiting_.size());
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
