#include "server/catalog/catalog.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/check.h"
#include "common/tensor/dtype.h"
#include "common/shm/fast_path_layout.h"
#include "common/tensor/layout.h"
#include "common/tensor/name.h"
#include "common/shm/tensor_record.h"
#include "common/tensor/wire.h"
#include "server/ops/log.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {
namespace {

HostPoolOptions PoolOptions(const CatalogOptions& options) {
  return HostPoolOptions{options.shm_prefix, options.host_pool_bytes, options.host_segment_bytes,
                         options.backing,    options.owner_uid,       options.instance_id};
}

}  // namespace

absl::StatusOr<std::unique_ptr<Catalog>> Catalog::Create(const CatalogOptions& options) {
  if (options.max_tensors == 0) {
    return absl::InvalidArgumentError("max tensors = 0: must be at least 1");
  }
  absl::StatusOr<ControlSegment> control =
      ControlSegment::Create(options.shm_prefix, options.max_tensors, options.host_pool_bytes,
                             options.host_segment_bytes, options.backing);
  if (!control.ok()) return control.status();
  absl::StatusOr<CatalogIndex> index =
      CatalogIndex::Create(options.max_tensors, options.instance_id);
  if (!index.ok()) return index.status();
  std::unique_ptr<Catalog> catalog(
      new Catalog(*std::move(control), *std::move(index), options.instance_id));
  absl::StatusOr<HostPool> pool = HostPool::Create(PoolOptions(options), &catalog->control_);
  if (!pool.ok()) return pool.status();
  catalog->pool_.emplace(*std::move(pool));
  return catalog;
}

Catalog::Catalog(ControlSegment control, CatalogIndex index, uint64_t instance_id,
                 bool all_slots_free)
    : control_(std::move(control)), index_(std::move(index)), instance_id_(instance_id) {
  if (!all_slots_free) return;
  const uint32_t count = control_.record_count();
  free_slots_.reserve(count);
  for (uint32_t slot = count; slot-- > 0;) free_slots_.push_back(slot);
}

absl::StatusOr<std::unique_ptr<Catalog>> Catalog::Recover(const CatalogOptions& options) {
  if (options.backing != SegmentBacking::kNamed) {
    return absl::FailedPreconditionError("recovery needs named segments (--segments shm)");
  }
  absl::StatusOr<ControlSegment> control = ControlSegment::Open(options.shm_prefix);
  if (!control.ok()) return control.status();
  absl::StatusOr<CatalogIndex> index =
      CatalogIndex::Create(control->record_count(), options.instance_id);
  if (!index.ok()) {
    control->Keep();
    return index.status();
  }
  std::unique_ptr<Catalog> catalog(new Catalog(*std::move(control), *std::move(index),
                                               options.instance_id, /*all_slots_free=*/false));
  absl::StatusOr<HostPool> pool = HostPool::Recover(PoolOptions(options), &catalog->control_);
  if (!pool.ok()) {
    catalog->control_.Keep();  // a failed recovery leaves the objects in place (see HostPool)
    return pool.status();
  }
  catalog->pool_.emplace(*std::move(pool));

  const uint32_t count = catalog->control_.record_count();
  // Published records, by name: the highest publish_seq wins (a replace that was cut short
  // leaves two); the others are unbound.
  std::unordered_map<std::string, uint64_t> winners;  // name -> tensor id
  uint64_t highest_id = 0;
  uint64_t highest_seq = 0;
  TensorRecord copy;
  for (uint32_t slot = count; slot-- > 0;) {
    TensorRecord& record = catalog->control_.record(slot);
    record.state.load(std::memory_order_acquire);  // orders the copy after the commit
    CopyRecord(record, copy);
    const auto state = static_cast<RecordState>(copy.state.load(std::memory_order_relaxed));
    if (state != RecordState::kPublished && state != RecordState::kUnbound &&
        state != RecordState::kWriting) {
      catalog->free_slots_.push_back(slot);
      continue;
    }
    // Unpublished buffers are kept too: their producer may reconnect and publish them.
    if (!catalog->Restore(slot, copy, state)) {
      record.state.store(static_cast<uint32_t>(RecordState::kFree), std::memory_order_release);
      catalog->free_slots_.push_back(slot);
      continue;
    }
    Tensor& tensor = catalog->tensors_.at(copy.tensor_id);
    highest_id = std::max(highest_id, tensor.id);
    highest_seq = std::max(highest_seq, tensor.publish_seq);
    if (state != RecordState::kPublished) continue;
    auto [it, inserted] = winners.emplace(tensor.record_name, tensor.id);
    if (!inserted) {
      Tensor& other = catalog->tensors_.at(it->second);
      Tensor* loser = &tensor;
      if (tensor.publish_seq > other.publish_seq) {
        loser = &other;
        it->second = tensor.id;
      }
      catalog->WriteRecordState(*loser, RecordState::kUnbound);
    }
  }
  for (const auto& [name, id] : winners) {
    Tensor& tensor = catalog->tensors_.at(id);
    tensor.name = name;
    catalog->names_.emplace(name, id);
    catalog->index_.Bind(NameHash(name.data(), name.size()), tensor.slot, id, std::nullopt);
  }
  // The counters go on from the larger of the header's word (tensors freed before the restart
  // had ids up to it) and what the records hold; a header word no daemon could have reached was
  // written by something else and is ignored.
  ControlHeader& header = catalog->control_.header();
  const uint64_t header_id = header.next_tensor_id.load(std::memory_order_relaxed);
  const uint64_t header_seq = header.next_publish_seq.load(std::memory_order_relaxed);
  catalog->next_tensor_id_ = highest_id + 1;
  catalog->next_publish_seq_ = highest_seq + 1;
  if (header_id <= kMaxRecordCounter) {
    catalog->next_tensor_id_ = std::max(catalog->next_tensor_id_, header_id);
  } else {
    TSM_LOG(kWarning) << "recovery: " << catalog->control_.name() << " header next_tensor_id "
                      << header_id << " is past any id a daemon hands out; continuing from "
                      << catalog->next_tensor_id_;
  }
  if (header_seq <= kMaxRecordCounter) {
    catalog->next_publish_seq_ = std::max(catalog->next_publish_seq_, header_seq);
  } else {
    TSM_LOG(kWarning) << "recovery: " << catalog->control_.name() << " header next_publish_seq "
                      << header_seq << " is past any sequence a daemon hands out; continuing from "
                      << catalog->next_publish_seq_;
  }
  header.next_tensor_id.store(catalog->next_tensor_id_, std::memory_order_relaxed);
  header.next_publish_seq.store(catalog->next_publish_seq_, std::memory_order_relaxed);
  catalog->in_grace_ = true;
  return catalog;
}

void Catalog::AddCudaPool(std::unique_ptr<CudaPool> pool) {
  const int ordinal = pool->ordinal();
  TSM_CHECK(cuda_pools_.emplace(ordinal, std::move(pool)).second);
}

const CudaPool* Catalog::cuda_pool(int ordinal) const {
  auto it = cuda_pools_.find(ordinal);
  return it == cuda_pools_.end() ? nullptr : it->second.get();
}

std::vector<const CudaPool*> Catalog::cuda_pools() const {
  std::vector<const CudaPool*> pools;
  for (const auto& [ordinal, pool] : cuda_pools_) pools.push_back(pool.get());
  return pools;
}

bool Catalog::Restore(uint32_t slot, const TensorRecord& record, RecordState state) {
  const bool unpublished = state == RecordState::kWriting;
  if (record.device_type == kDLCUDA) {
    // Device memory belongs to the process that allocated it: it ended with the old daemon.
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << ") was on cuda:" << record.device_id
                      << ", whose memory ended with the old daemon; dropped";
    return false;
  }
  const std::string name(record.name, std::min<size_t>(record.name_length, sizeof(record.name)));
  if (record.device_type != kDLCPU || record.device_id != 0 || record.tensor_id == 0 ||
      record.tensor_id > kMaxRecordCounter || record.publish_seq > kMaxRecordCounter ||
      (record.name_length == 0) != unpublished ||
      (!unpublished && (record.name_length > kMaxNameLength || !ValidateName(name).ok())) ||
      tensors_.count(record.tensor_id) > 0) {
    TSM_LOG(kWarning) << "recovery: record " << slot << " is not a valid tensor; dropped";
    return false;
  }
  absl::StatusOr<RecordLayout> decoded = DecodeRecordLayout(record);
  if (!decoded.ok()) {
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << ") is not a valid tensor (" << decoded.status().message() << "); dropped";
    return false;
  }
  Tensor tensor;
  tensor.id = record.tensor_id;
  tensor.slot = slot;
  tensor.device = DLDevice{kDLCPU, 0};
  tensor.buffer = Buffer{record.segment_id, record.offset, record.length};
  if (record.owner_uid != pool_->owner_uid()) {
    // Another uid's buffers are in segments reserved to it, sealed memfds that nothing outlives.
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << (unpublished ? "" : absl::StrCat(", \"", LogEscape(name), "\""))
                      << ") was uid " << record.owner_uid
                      << "'s, in a memfd segment reserved to that uid, whose memory ended with the "
                         "old daemon (only the daemon's own uid's tensors survive a restart); "
                         "dropped";
    return false;
  }
  const uint64_t page = HostPool::PageSize();
  if (tensor.buffer.offset % page != 0 || tensor.buffer.length % page != 0 ||
      (tensor.buffer.length > 0 && !pool_->Reserve(tensor.buffer))) {
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << ") does not fit its buffer or overlaps another; dropped";
    return false;
  }
  SetLayout(tensor, decoded->dtype, decoded->shape, std::move(decoded->layout),
            decoded->subbyte_padded);
  tensor.sealed = !unpublished;
  tensor.owner_uid = record.owner_uid;
  tensor.recovered = true;
  tensor.publish_seq = record.publish_seq;
  tensor.last_use = absl::Now();  // use_seq 0: older than anything this daemon saw used
  // Shown to operators only; a time past now (a wrong clock, a scribbled record) is unknown.
  if (!unpublished && record.published_unix_ms > 0 &&
      record.published_unix_ms <= absl::ToUnixMillis(absl::Now())) {
    tensor.published_unix_ms = record.published_unix_ms;
  }
  tensor.record_state = state;
  tensor.record_name = name;
  const uint32_t uid = tensor.owner_uid;
  if (tensors_.emplace(tensor.id, std::move(tensor)).second) CountRecord(uid, 1);
  return true;
}

int Catalog::ExpireUnbound() {
  in_grace_ = false;
  int freed = 0;
  for (auto it = tensors_.begin(); it != tensors_.end();) {
    auto next = std::next(it);
    Tensor& tensor = it->second;
    tensor.recovered = false;
    const bool orphaned = !tensor.sealed && tensor.owner_session == 0;
    if (orphaned) {
      Free(it);
      ++freed;
    } else if (tensor.sealed && tensor.name.empty()) {
      const size_t before = tensors_.size();
      FreeIfUnheld(it);
      freed += static_cast<int>(before - tensors_.size());
    }
    it = next;
  }
  return freed;
}

absl::Status Catalog::ReattachLease(uint64_t tensor_id) {
  if (!in_grace_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor_id = ", tensor_id, ": leases are re-registered only in a restart's grace period"));
  }
  auto it = tensors_.find(tensor_id);
  if (it == tensors_.end() || !it->second.sealed) {
    return absl::NotFoundError(
        absl::StrCat("tensor_id = ", tensor_id, ": no such published tensor"));
  }
  ++it->second.leases;
  return absl::OkStatus();
}

absl::Status Catalog::Readopt(uint64_t session, uint32_t uid, uint64_t tensor_id) {
  if (!in_grace_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor_id = ", tensor_id, ": tensors are taken back only in a restart's grace period"));
  }
  auto it = tensors_.find(tensor_id);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor_id = ", tensor_id, ": no such tensor"));
  }
  Tensor& tensor = it->second;
  if (tensor.sealed || tensor.owner_session != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor_id = ", tensor_id, ": published or already taken back"));
  }
  if (tensor.owner_uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat("tensor_id = ", tensor_id, ": created by uid ",
                                                    tensor.owner_uid, ", not uid ", uid));
  }
  tensor.owner_session = session;
  return absl::OkStatus();
}

void Catalog::Unbind(std::map<uint64_t, Tensor>::iterator it) {
  it->second.name.clear();
  WriteRecordState(it->second, RecordState::kUnbound);
  // Its index entry went before: the lease pages are read for it now, once.
  lease_board_.Unbound(it->second.id, CanHold());
  FreeIfUnheld(it);
}

bool Catalog::Acquirable(uint64_t session, uint64_t tensor_id) const {
  auto it = tensors_.find(tensor_id);
  if (it == tensors_.end()) return false;
  const Tensor& tensor = it->second;
  return tensor.sealed ? !tensor.name.empty() : tensor.owner_session == session && session != 0;
}

void Catalog::FreeIfUnheld(std::map<uint64_t, Tensor>::iterator it) {
  const Tensor& tensor = it->second;
  if (!tensor.name.empty() || tensor.leases > 0 || tensor.recovered) return;
  if (lease_board_.Holds(tensor.id, CanHold())) {
    retired_.insert(tensor.id);
    return;
  }
  Free(it);
}

void Catalog::ReadLeasePages() { lease_board_.Read(CanHold()); }

int64_t Catalog::PageLeasesOf(uint64_t session) {
  lease_board_.ReadPage(session, CanHold());
  return lease_board_.SlotsHeld(session);
}

int Catalog::Reclaim() {
  int freed = 0;
  for (auto id = retired_.begin(); id != retired_.end();) {
    const uint64_t tensor_id = *id++;
    auto it = tensors_.find(tensor_id);
    if (it == tensors_.end()) {
      retired_.erase(tensor_id);
      continue;
    }
    if (it->second.leases > 0 || it->second.recovered || lease_board_.Holds(tensor_id, CanHold())) {
      continue;
    }
    Free(it);  // erases it from retired_
    ++freed;
  }
  return freed;
}

int64_t Catalog::LeaseCount(const Tensor& tensor) const {
  const std::unordered_map<uint64_t, int64_t>& held = lease_board_.Held();
  auto it = held.find(tensor.id);
  return tensor.leases + (it == held.end() ? 0 : it->second);
}

void Catalog::KeepSegments() {
  control_.Keep();
  pool_->KeepSegments();
}

void Catalog::SetLayout(Tensor& tensor, const DLDataType& dtype, absl::Span<const int64_t> shape,
                        TensorLayout layout, bool subbyte_padded) {
  tensor.dtype = dtype;
  tensor.shape.assign(shape.begin(), shape.end());
  tensor.strides = std::move(layout.strides);
  tensor.byte_offset = layout.byte_offset;
  tensor.nbytes = layout.nbytes;
  tensor.subbyte_padded = subbyte_padded;
}

void Catalog::WriteRecordLayout(const Tensor& tensor, TensorRecord& record) {
  record.dtype_code = tensor.dtype.code;
  record.dtype_bits = tensor.dtype.bits;
  record.dtype_lanes = tensor.dtype.lanes;
  record.ndim = static_cast<int32_t>(tensor.shape.size());
  record.byte_offset = tensor.byte_offset;
  record.nbytes = tensor.nbytes;
  record.dlpack_flags = tensor.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0;
  std::copy(tensor.shape.begin(), tensor.shape.end(), record.shape);
  std::copy(tensor.strides.begin(), tensor.strides.end(), record.strides);
}

void Catalog::WriteRecordState(Tensor& tensor, RecordState state) {
  tensor.record_state = state;
  control_.record(tensor.slot).state.store(static_cast<uint32_t>(state), std::memory_order_release);
}

void Catalog::WriteNewRecord(Tensor& tensor) {
  TensorRecord& record = control_.record(tensor.slot);
  // Whatever the slot held (a freed tensor's fields, or another process's bytes) goes: free
  // first, then every byte after the state word, then the fields, then the state.
  record.state.store(static_cast<uint32_t>(RecordState::kFree), std::memory_order_release);
  static_assert(offsetof(TensorRecord, state) == 0);
  std::memset(reinterpret_cast<char*>(&record) + sizeof(record.state), 0,
              sizeof(TensorRecord) - sizeof(record.state));
  record.name_length = 0;
  record.tensor_id = tensor.id;
  record.publish_seq = 0;
  record.segment_id = tensor.buffer.segment_id;
  record.offset = tensor.buffer.offset;
  record.length = tensor.buffer.length;
  record.device_type = tensor.device.device_type;
  record.device_id = tensor.device.device_id;
  record.owner_uid = tensor.owner_uid;
  WriteRecordLayout(tensor, record);
  tensor.publish_seq = 0;
  tensor.record_name.clear();
  WriteRecordState(tensor, RecordState::kWriting);
}

uint64_t Catalog::TakeTensorId() {
  const uint64_t id = next_tensor_id_++;
  control_.header().next_tensor_id.store(next_tensor_id_, std::memory_order_relaxed);
  return id;
}

uint64_t Catalog::TakePublishSeq() {
  const uint64_t seq = next_publish_seq_++;
  control_.header().next_publish_seq.store(next_publish_seq_, std::memory_order_relaxed);
  return seq;
}

std::string Catalog::RecordMismatch(const Tensor& tensor) const {
  TensorRecord found;
  CopyRecord(control_.record(tensor.slot), found);
  auto differs = [](absl::string_view field, auto value, auto expected) {
    return absl::StrCat(field, " ", value, " (the daemon wrote ", expected, ")");
  };
  const uint32_t state = found.state.load(std::memory_order_relaxed);
  if (state != static_cast<uint32_t>(tensor.record_state)) {
    return differs("state", state, static_cast<uint32_t>(tensor.record_state));
  }
  if (found.tensor_id != tensor.id) return differs("tensor_id", found.tensor_id, tensor.id);
  if (found.publish_seq != tensor.publish_seq) {
    return differs("publish_seq", found.publish_seq, tensor.publish_seq);
  }
  if (found.name_length != tensor.record_name.size()) {
    return differs("name_length", found.name_length, tensor.record_name.size());
  }
  if (std::memcmp(found.name, tensor.record_name.data(), tensor.record_name.size()) != 0) {
    return absl::StrCat("name \"",
                        absl::CHexEscape(absl::string_view(found.name, tensor.record_name.size())),
                        "\" (the daemon wrote \"", tensor.record_name, "\")");
  }
  if (found.segment_id != tensor.buffer.segment_id) {
    return differs("segment_id", found.segment_id, tensor.buffer.segment_id);
  }
  if (found.offset != tensor.buffer.offset) {
    return differs("offset", found.offset, tensor.buffer.offset);
  }
  if (found.length != tensor.buffer.length) {
    return differs("length", found.length, tensor.buffer.length);
  }
  if (found.device_type != tensor.device.device_type ||
      found.device_id != tensor.device.device_id) {
    return differs("device", absl::StrCat(found.device_type, ":", found.device_id),
                   DeviceName(tensor.device));
  }
  if (found.dtype_code != tensor.dtype.code || found.dtype_bits != tensor.dtype.bits ||
      found.dtype_lanes != tensor.dtype.lanes) {
    return differs("dtype",
                   absl::StrCat("(code ", found.dtype_code, ", bits ", found.dtype_bits, ", lanes ",
                                found.dtype_lanes, ")"),
                   DataTypeName(tensor.dtype));
  }
  const auto ndim = static_cast<int32_t>(tensor.shape.size());
  if (found.ndim != ndim) return differs("ndim", found.ndim, ndim);
  for (int32_t i = 0; i < ndim; ++i) {
    if (found.shape[i] != tensor.shape[i]) {
      return differs(absl::StrCat("shape[", i, "]"), found.shape[i], tensor.shape[i]);
    }
    if (found.strides[i] != tensor.strides[i]) {
      return differs(absl::StrCat("strides[", i, "]"), found.strides[i], tensor.strides[i]);
    }
  }
  if (found.byte_offset != tensor.byte_offset) {
    return differs("byte_offset", found.byte_offset, tensor.byte_offset);
  }
  if (found.nbytes != tensor.nbytes) return differs("nbytes", found.nbytes, tensor.nbytes);
  const uint64_t flags = tensor.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0;
  if (found.dlpack_flags != flags) return differs("dlpack_flags", found.dlpack_flags, flags);
  if (found.owner_uid != tensor.owner_uid) {
    return differs("owner_uid", found.owner_uid, tensor.owner_uid);
  }
  return "";
}

void Catalog::MarkDamaged(Tensor& tensor, std::string found) {
  tensor.damage = std::move(found);
  std::string what;
  std::string consequence;
  if (!tensor.name.empty()) {
    what = absl::StrCat(" \"", tensor.name, "\"");
    consequence = "acquiring it answers DATA_LOSS until it is deleted or replaced";
  } else if (tensor.sealed) {
    what = " (unbound)";
    consequence = "it is freed once unleased";
  } else {
    what = " (unpublished)";
    consequence = "publishing it answers DATA_LOSS";
  }
  TSM_LOG(kError) << "tensor " << tensor.id << what << ": its record in " << control_.name()
                  << " was overwritten by another process: found " << tensor.damage << "; "
                  << consequence;
  if (!tensor.name.empty()) {
    // The entry stays (the name is bound) but sends readers to the daemon.
    index_.Bind(NameHash(tensor.name.data(), tensor.name.size()), tensor.slot, kIndexAskDaemon,
                tensor.slot);
  }
}

absl::Status Catalog::DamageError(const Tensor& tensor) const {
  const std::string& name = tensor.name.empty() ? tensor.record_name : tensor.name;
  const std::string what = name.empty() ? absl::StrCat("tensor_id = ", tensor.id, " (unpublished)")
                                        : absl::StrCat("name = \"", name, "\"");
  return absl::DataLossError(
      absl::StrCat(what, ": tensor ", tensor.id, "'s record in ", control_.name(),
                   " was overwritten by another process (found ", tensor.damage, "); ",
                   name.empty() ? "create the tensor again"
                                : "its publisher can delete it or publish a replacement"));
}

absl::Status Catalog::Verify(uint64_t tensor_id) {
  auto it = tensors_.find(tensor_id);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor_id = ", tensor_id, ": no such tensor"));
  }
  Tensor& tensor = it->second;
  if (tensor.damage.empty()) {
    std::string found = RecordMismatch(tensor);
    if (found.empty()) return absl::OkStatus();
    MarkDamaged(tensor, std::move(found));
  }
  return DamageError(tensor);
}

int Catalog::CheckRecords(size_t budget) {
  const bool header = control_.RepairHeader(next_tensor_id_, next_publish_seq_);
  const int segments = pool_->RepairSegmentRecords();
  if ((header || segments > 0) && !reported_repair_) {
    reported_repair_ = true;
    TSM_LOG(kError) << control_.name() << ": another process wrote " << (header ? "the header" : "")
                    << (header && segments > 0 ? " and " : "")
                    << (segments > 0 ? absl::StrCat(segments, " segment records") : "")
                    << "; rewritten as the daemon knows them (logged once)";
  }
  int damaged = 0;
  budget = std::min(budget, tensors_.size());
  auto it = tensors_.upper_bound(sweep_after_);
  for (size_t checked = 0; checked < budget; ++checked) {
    if (it == tensors_.end()) it = tensors_.begin();
    Tensor& tensor = it->second;
    if (tensor.damage.empty()) {
      std::string found = RecordMismatch(tensor);
      if (!found.empty()) {
        MarkDamaged(tensor, std::move(found));
        ++damaged;
      }
    }
    sweep_after_ = it->first;
    ++it;
  }
  return damaged;
}

int64_t Catalog::damaged_count() const {
  int64_t count = 0;
  for (const auto& [id, tensor] : tensors_) count += tensor.damage.empty() ? 0 : 1;
  return count;
}

absl::StatusOr<const Tensor*> Catalog::Create(uint64_t session, const DLDataType& dtype,
                                              absl::Span<const int64_t> shape,
                                              absl::Span<const int64_t> strides,
                                              const DLDevice& device, bool subbyte_padded,
                                              uint32_t owner_uid, SegmentGrowth* growth) {
  CudaPool* cuda = nullptr;
  if (device.device_type == kDLCUDA) {
    auto it = cuda_pools_.find(device.device_id);
    if (it == cuda_pools_.end()) {
      std::string pools;
      for (const auto& [ordinal, pool] : cuda_pools_) {
        absl::StrAppend(&pools, pools.empty() ? "" : ", ", "cuda:", ordinal);
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "device = cuda:", device.device_id, ": this tensorshmd has no pool for the device (",
          pools.empty() ? "host pool only" : "CUDA pools: " + pools, "; see --cuda-pool)"));
    }
    cuda = it->second.get();
  } else if (device.device_type != kDLCPU) {
    return absl::InvalidArgumentError(
        absl::StrCat("device = {type: ", device.device_type, ", id: ", device.device_id,
                     "}: only cpu (1) and cuda (2) tensors are supported"));
  } else if (device.device_id != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device = cpu:", device.device_id, ": the cpu device id must be 0"));
  }
  absl::StatusOr<TensorLayout> layout = ComputeLayout(dtype, shape, strides, subbyte_padded);
  if (!layout.ok()) return layout.status();
  if (uid_tensors_ > 0 && RecordsOf(owner_uid) >= uid_tensors_) {
    return TensorRecordsExhausted(owner_uid, RecordsOf(owner_uid), uid_tensors_);
  }
  if (free_slots_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("catalog: all ", control_.record_count(),
                                                     " tensor records in use (--max-tensors)"));
  }
  Buffer buffer;
  if (layout->nbytes > 0) {
    const uint64_t nbytes = static_cast<uint64_t>(layout->nbytes);
    GrowthRequest* request = nullptr;
    if (growth != nullptr) {
      growth->cuda_ordinal = cuda != nullptr ? device.device_id : -1;
      request = &growth->request;
    }
    absl::StatusOr<Buffer> allocated = cuda != nullptr
                                           ? cuda->Allocate(nbytes, request)
                                           : pool_->Allocate(nbytes, owner_uid, request);
    if (!allocated.ok()) return allocated.status();
    buffer = *allocated;
  }
  const uint32_t slot = free_slots_.back();
  free_slots_.pop_back();

  Tensor tensor;
  tensor.id = TakeTensorId();
  tensor.slot = slot;
  tensor.device = device;
  SetLayout(tensor, dtype, shape, *std::move(layout), subbyte_padded);
  tensor.buffer = buffer;
  tensor.owner_session = session;
  tensor.owner_uid = owner_uid;
  WriteNewRecord(tensor);

  auto [it, inserted] = tensors_.emplace(tensor.id, std::move(tensor));
  TSM_CHECK(inserted);
  CountRecord(owner_uid, 1);
  return &it->second;
}

uint64_t Catalog::RecordsOf(uint32_t uid) const {
  auto it = records_of_.find(uid);
  return it == records_of_.end() ? 0 : it->second;
}

void Catalog::CountRecord(uint32_t uid, int delta) {
  if (delta > 0) {
    ++records_of_[uid];
    return;
  }
  auto it = records_of_.find(uid);
  TSM_CHECK(it != records_of_.end() && it->second > 0);
  if (--it->second == 0) records_of_.erase(it);
}

void SegmentGrowth::Make() {
  if (cuda_pool != nullptr) {
    cuda_segment = cuda_pool->MakeSegment(request);
  } else {
    TSM_CHECK(host_pool != nullptr);
    // The room first: their pages are what the new segment's reservation may need.
    HostPool::DisposeSegments(std::move(given_back));
    given_back.clear();
    host_segment = host_pool->MakeSegment(request);
  }
}

void Catalog::BeginGrowth(SegmentGrowth& growth) {
  TSM_CHECK(growth.needed());
  if (growth.cuda_ordinal >= 0) {
    CudaPool* pool = cuda_pools_.at(growth.cuda_ordinal).get();
    pool->BeginGrowth();
    growth.cuda_pool = pool;
  } else {
    growth.given_back = pool_->BeginGrowth(growth.request);
    growth.host_pool = &*pool_;
  }
}

absl::Status Catalog::EndGrowth(SegmentGrowth& growth) {
  if (growth.cuda_ordinal >= 0) {
    return cuda_pools_.at(growth.cuda_ordinal)
        ->EndGrowth(growth.request, std::move(growth.cuda_segment));
  }
  return pool_->EndGrowth(growth.request, std::move(growth.host_segment));
}

absl::Status Catalog::Publish(uint64_t session, uint64_t tensor_id, const std::string& name,
                              bool replace, std::string ready_event, int64_t publisher_pid) {
  absl::StatusOr<std::map<uint64_t, Tensor>::iterator> it = FindUnpublished(session, tensor_id);
  if (!it.ok()) return it.status();
  Tensor& tensor = (*it)->second;
  auto bound = names_.find(name);
  if (bound != names_.end() && !replace) {
    return absl::AlreadyExistsError(absl::StrCat("name = \"", name,
                                                 "\": already published (tensor ", bound->second,
                                                 "); delete it first or publish with replace"));
  }

  // The commit below vouches for the record: it must still say what the daemon wrote.
  if (absl::Status s = Verify(tensor_id); !s.ok()) return s;

  TensorRecord& record = control_.record(tensor.slot);
  std::memcpy(record.name, name.data(), name.size());
  record.name_length = static_cast<uint32_t>(name.size());
  tensor.record_name = name;
  tensor.publish_seq = TakePublishSeq();
  record.publish_seq = tensor.publish_seq;
  tensor.published_unix_ms = absl::ToUnixMillis(absl::Now());
  record.published_unix_ms = tensor.published_unix_ms;
  tensor.publisher_pid = publisher_pid;
  Unstock(tensor);
  tensor.sealed = true;
  tensor.owner_session = 0;
  tensor.name = name;
  tensor.ready_event = std::move(ready_event);
  Touch(tensor);
  tensor.acquired = false;
  // Commit point: from here a restarted daemon serves the new tensor under `name` (the highest
  // publish_seq wins if the old record below is still marked published).
  WriteRecordState(tensor, RecordState::kPublished);

  // The index entry follows the committed record; a replaced tensor leaves the index in the same
  // step, before its lease pages are scanned.
  const uint64_t hash = NameHash(name.data(), name.size());
  if (bound != names_.end()) {
    auto old = tensors_.find(bound->second);
    TSM_CHECK(old != tensors_.end());
    bound->second = tensor_id;
    index_.Bind(hash, tensor.slot, tensor_id, old->second.slot);
    Unbind(old);
  } else {
    names_.emplace(name, tensor_id);
    index_.Bind(hash, tensor.slot, tensor_id, std::nullopt);
  }
  index_.NotifyPublished();
  return absl::OkStatus();
}

absl::Status Catalog::Reshape(uint64_t session, uint64_t tensor_id, const DLDataType& dtype,
                              absl::Span<const int64_t> shape, absl::Span<const int64_t> strides,
                              bool subbyte_padded) {
  absl::StatusOr<std::map<uint64_t, Tensor>::iterator> it = FindUnpublished(session, tensor_id);
  if (!it.ok()) return it.status();
  Tensor& tensor = (*it)->second;
  if (tensor.device.device_type != kDLCPU) {
    return absl::InvalidArgumentError(absl::StrCat(
        "desc: tensor ", tensor_id, " is on ", DeviceName(tensor.device), "; only host tensors"));
  }
  absl::StatusOr<TensorLayout> layout = ComputeLayout(dtype, shape, strides, subbyte_padded);
  if (!layout.ok()) return layout.status();
  const uint64_t extent = layout->byte_offset + static_cast<uint64_t>(layout->nbytes);
  if (extent > tensor.buffer.length || (layout->nbytes > 0 && tensor.buffer.length == 0)) {
    return absl::InvalidArgumentError(absl::StrCat("desc: ", extent, " bytes do not fit tensor ",
                                                   tensor_id, "'s buffer of ", tensor.buffer.length,
                                                   " bytes"));
  }
  SetLayout(tensor, dtype, shape, *std::move(layout), subbyte_padded);
  WriteRecordLayout(tensor, control_.record(tensor.slot));
  return absl::OkStatus();
}

const Tensor* Catalog::Find(const std::string& name) const {
  auto bound = names_.find(name);
  if (bound == names_.end()) return nullptr;
  return FindId(bound->second);
}

const Tensor* Catalog::FindId(uint64_t tensor_id) const {
  auto it = tensors_.find(tensor_id);
  return it == tensors_.end() ? nullptr : &it->second;
}

void Catalog::AddLease(uint64_t tensor_id) {
  auto it = tensors_.find(tensor_id);
  TSM_CHECK(it != tensors_.end() && it->second.sealed);
  ++it->second.leases;
  Touch(it->second);
}

void Catalog::DropLease(uint64_t tensor_id) {
  auto it = tensors_.find(tensor_id);
  TSM_CHECK(it != tensors_.end() && it->second.leases > 0);
  if (--it->second.leases == 0) {
    ++release_epoch_;  // freed now, or evictable
    FreeIfUnheld(it);
  }
}

absl::Status Catalog::Delete(const std::string& name) {
  auto bound = names_.find(name);
  if (bound == names_.end()) {
    return absl::NotFoundError(absl::StrCat("name = \"", name, "\": not published"));
  }
  auto it = tensors_.find(bound->second);
  TSM_CHECK(it != tensors_.end());
  index_.Unbind(NameHash(name.data(), name.size()), it->second.slot);
  names_.erase(bound);
  Unbind(it);
  return absl::OkStatus();
}

absl::Status Catalog::Abandon(uint64_t session, uint64_t tensor_id) {
  absl::StatusOr<std::map<uint64_t, Tensor>::iterator> it = FindUnpublished(session, tensor_id);
  if (!it.ok()) return it.status();
  Free(*it);
  return absl::OkStatus();
}

absl::StatusOr<std::map<uint64_t, Tensor>::iterator> Catalog::FindUnpublished(uint64_t session,
                                                                              uint64_t tensor_id) {
  auto it = tensors_.find(tensor_id);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor_id = ", tensor_id, ": no such tensor"));
  }
  if (it->second.sealed) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor_id = ", tensor_id, ": already published"));
  }
  if (it->second.owner_session != session) {
    return absl::PermissionDeniedError(
        absl::StrCat("tensor_id = ", tensor_id, ": created by another session"));
  }
  return it;
}

std::vector<const Tensor*> Catalog::List(const std::string& prefix) const {
  std::vector<const Tensor*> found;
  for (const auto& [name, id] : names_) {
    if (name.compare(0, prefix.size(), prefix) == 0) found.push_back(FindId(id));
  }
  std::sort(found.begin(), found.end(),
            [](const Tensor* a, const Tensor* b) { return a->name < b->name; });
  return found;
}

void Catalog::MarkStocked(uint64_t tensor_id) {
  auto it = tensors_.find(tensor_id);
  TSM_CHECK(it != tensors_.end());
  Tensor& tensor = it->second;
  TSM_CHECK(!tensor.sealed && !tensor.stocked && tensor.device.device_type == kDLCPU &&
            tensor.buffer.length > 0);
  tensor.stocked = true;
  ++stocked_tensors_;
  stock_bytes_ += tensor.buffer.length;
}

void Catalog::Unstock(Tensor& tensor) {
  if (!tensor.stocked) return;
  tensor.stocked = false;
  TSM_CHECK(stocked_tensors_ > 0 && stock_bytes_ >= tensor.buffer.length);
  --stocked_tensors_;
  stock_bytes_ -= tensor.buffer.length;
}

void Catalog::Free(std::map<uint64_t, Tensor>::iterator it) {
  Unstock(it->second);
  // The record goes free before the memory is reused, so a restart never sees two live records
  // over one buffer.
  WriteRecordState(it->second, RecordState::kFree);
  if (it->second.buffer.length > 0) {
    if (it->second.device.device_type == kDLCUDA) {
      cuda_pools_.at(it->second.device.device_id)->Free(it->second.buffer);
    } else {
      pool_->Free(it->second.buffer);
    }
  }
  free_slots_.push_back(it->second.slot);
  retired_.erase(it->first);
  lease_board_.Forget(it->first);
  CountRecord(it->second.owner_uid, -1);
  tensors_.erase(it);
  ++release_epoch_;
}

}  // namespace tensorshm
