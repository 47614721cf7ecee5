#include "server/catalog.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/dtype.h"
#include "common/fast_path_layout.h"
#include "common/layout.h"
#include "common/name.h"
#include "common/wire.h"
#include "server/log.h"

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
  if (!index.ok()) return index.status();
  std::unique_ptr<Catalog> catalog(new Catalog(*std::move(control), *std::move(index),
                                               options.instance_id, /*all_slots_free=*/false));
  absl::StatusOr<HostPool> pool = HostPool::Recover(PoolOptions(options), &catalog->control_);
  if (!pool.ok()) return pool.status();
  catalog->pool_.emplace(*std::move(pool));

  const uint32_t count = catalog->control_.record_count();
  // Published records, by name: the highest publish_seq wins (a replace that was cut short
  // leaves two); the others are unbound.
  std::unordered_map<std::string, uint32_t> winners;
  for (uint32_t slot = count; slot-- > 0;) {
    TensorRecord& record = catalog->control_.record(slot);
    const auto state = static_cast<RecordState>(record.state.load(std::memory_order_acquire));
    if (state != RecordState::kPublished && state != RecordState::kUnbound &&
        state != RecordState::kWriting) {
      catalog->free_slots_.push_back(slot);
      continue;
    }
    // Unpublished buffers are kept too: their producer may reconnect and publish them.
    if (!catalog->Restore(slot, state == RecordState::kWriting)) {
      record.state.store(static_cast<uint32_t>(RecordState::kFree), std::memory_order_release);
      catalog->free_slots_.push_back(slot);
      continue;
    }
    if (state == RecordState::kPublished) {
      const std::string name(record.name, record.name_length);
      auto [it, inserted] = winners.emplace(name, slot);
      if (!inserted) {
        TensorRecord& other = catalog->control_.record(it->second);
        uint32_t loser = slot;
        if (record.publish_seq > other.publish_seq) {
          loser = it->second;
          it->second = slot;
        }
        catalog->control_.record(loser).state.store(static_cast<uint32_t>(RecordState::kUnbound),
                                                    std::memory_order_release);
      }
    }
  }
  for (auto& [id, tensor] : catalog->tensors_) {
    TensorRecord& record = catalog->control_.record(tensor.slot);
    const std::string name(record.name, record.name_length);
    auto it = winners.find(name);
    if (record.state.load() == static_cast<uint32_t>(RecordState::kPublished) &&
        it != winners.end() && it->second == tensor.slot) {
      tensor.name = name;
      catalog->names_.emplace(name, id);
      catalog->index_.Bind(NameHash(name.data(), name.size()), tensor.slot, id, std::nullopt);
    }
  }
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

bool Catalog::Restore(uint32_t slot, bool unpublished) {
  const TensorRecord& record = control_.record(slot);
  if (record.device_type == kDLCUDA) {
    // Device memory belongs to the process that allocated it: it ended with the old daemon.
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << ") was on cuda:" << record.device_id
                      << ", whose memory ended with the old daemon; dropped";
    return false;
  }
  absl::StatusOr<DLDataType> dtype =
      MakeDataType(record.dtype_code, record.dtype_bits, record.dtype_lanes);
  const bool padded = record.dlpack_flags == DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED;
  if (!dtype.ok() || record.ndim < 0 || record.ndim > static_cast<int32_t>(kRecordMaxDims) ||
      (record.dlpack_flags != 0 && !padded) || (record.name_length == 0) != unpublished ||
      record.name_length > kMaxNameLength || record.device_type != kDLCPU ||
      tensors_.count(record.tensor_id) > 0) {
    TSM_LOG(kWarning) << "recovery: record " << slot << " is not a valid tensor; dropped";
    return false;
  }
  Tensor tensor;
  tensor.id = record.tensor_id;
  tensor.slot = slot;
  tensor.dtype = *dtype;
  tensor.device = DLDevice{kDLCPU, 0};
  tensor.shape.assign(record.shape, record.shape + record.ndim);
  absl::StatusOr<TensorLayout> layout =
      ComputeLayout(*dtype, tensor.shape, absl::MakeConstSpan(record.strides, record.ndim), padded);
  tensor.buffer = Buffer{record.segment_id, record.offset, record.length};
  const uint64_t page = HostPool::PageSize();
  if (!layout.ok() || layout->nbytes != record.nbytes ||
      layout->byte_offset != record.byte_offset ||
      static_cast<uint64_t>(layout->nbytes) > tensor.buffer.length ||
      tensor.buffer.offset % page != 0 || tensor.buffer.length % page != 0 ||
      (tensor.buffer.length > 0 && !pool_->Reserve(tensor.buffer))) {
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << ") does not fit its buffer or overlaps another; dropped";
    return false;
  }
  tensor.strides = std::move(layout->strides);
  tensor.byte_offset = layout->byte_offset;
  tensor.nbytes = layout->nbytes;
  tensor.subbyte_padded = padded;
  tensor.sealed = !unpublished;
  tensor.owner_uid = record.owner_uid;
  tensor.recovered = true;
  tensors_.emplace(tensor.id, std::move(tensor));
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
  FreeIfUnheld(it);
}

void Catalog::FreeIfUnheld(std::map<uint64_t, Tensor>::iterator it) {
  const Tensor& tensor = it->second;
  if (!tensor.name.empty() || tensor.leases > 0 || tensor.recovered) return;
  if (lease_board_.Holds(tensor.id)) {
    retired_.insert(tensor.id);
    return;
  }
  Free(it);
}

int Catalog::Reclaim() {
  if (retired_.empty()) return 0;
  const std::unordered_map<uint64_t, int64_t> held = lease_board_.Held();
  int freed = 0;
  for (auto id = retired_.begin(); id != retired_.end();) {
    const uint64_t tensor_id = *id++;
    auto it = tensors_.find(tensor_id);
    if (it == tensors_.end()) {
      retired_.erase(tensor_id);
      continue;
    }
    if (held.count(tensor_id) > 0 || it->second.leases > 0 || it->second.recovered) continue;
    Free(it);  // erases it from retired_
    ++freed;
  }
  return freed;
}

int64_t Catalog::LeaseCount(const Tensor& tensor) const {
  const std::unordered_map<uint64_t, int64_t> held = lease_board_.Held();
  auto it = held.find(tensor.id);
  return tensor.leases + (it == held.end() ? 0 : it->second);
}

int64_t Catalog::PageLeaseCount() const {
  int64_t count = 0;
  for (const auto& [id, slots] : lease_board_.Held()) count += slots;
  return count;
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

void Catalog::WriteRecordState(const Tensor& tensor, RecordState state) {
  control_.record(tensor.slot).state.store(static_cast<uint32_t>(state), std::memory_order_release);
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

  ControlHeader& header = control_.header();
  Tensor tensor;
  tensor.id = header.next_tensor_id.fetch_add(1, std::memory_order_relaxed);
  tensor.slot = slot;
  tensor.device = device;
  SetLayout(tensor, dtype, shape, *std::move(layout), subbyte_padded);
  tensor.buffer = buffer;
  tensor.owner_session = session;
  tensor.owner_uid = owner_uid;

  TensorRecord& record = control_.record(slot);
  TSM_CHECK(record.state.load(std::memory_order_acquire) ==
            static_cast<uint32_t>(RecordState::kFree));
  record.name_length = 0;
  record.tensor_id = tensor.id;
  record.publish_seq = 0;
  record.segment_id = buffer.segment_id;
  record.offset = buffer.offset;
  record.length = buffer.length;
  record.device_type = device.device_type;
  record.device_id = device.device_id;
  record.owner_uid = owner_uid;
  WriteRecordLayout(tensor, record);
  WriteRecordState(tensor, RecordState::kWriting);

  auto [it, inserted] = tensors_.emplace(tensor.id, std::move(tensor));
  TSM_CHECK(inserted);
  return &it->second;
}

void SegmentGrowth::Make() {
  if (cuda_pool != nullptr) {
    cuda_segment = cuda_pool->MakeSegment(request);
  } else {
    TSM_CHECK(host_pool != nullptr);
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
    pool_->BeginGrowth();
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
                              bool replace, std::string ready_event) {
  absl::StatusOr<std::map<uint64_t, Tensor>::iterator> it = FindUnpublished(session, tensor_id);
  if (!it.ok()) return it.status();
  Tensor& tensor = (*it)->second;
  auto bound = names_.find(name);
  if (bound != names_.end() && !replace) {
    return absl::AlreadyExistsError(absl::StrCat("name = \"", name,
                                                 "\": already published (tensor ", bound->second,
                                                 "); delete it first or publish with replace"));
  }

  TensorRecord& record = control_.record(tensor.slot);
  std::memcpy(record.name, name.data(), name.size());
  record.name_length = static_cast<uint32_t>(name.size());
  record.publish_seq = control_.header().next_publish_seq.fetch_add(1, std::memory_order_relaxed);
  tensor.sealed = true;
  tensor.owner_session = 0;
  tensor.name = name;
  tensor.ready_event = std::move(ready_event);
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
}

void Catalog::DropLease(uint64_t tensor_id) {
  auto it = tensors_.find(tensor_id);
  TSM_CHECK(it != tensors_.end() && it->second.leases > 0);
  if (--it->second.leases == 0) FreeIfUnheld(it);
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

void Catalog::Free(std::map<uint64_t, Tensor>::iterator it) {
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
  tensors_.erase(it);
}

}  // namespace tensorshm
