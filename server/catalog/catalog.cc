// The catalog: the table of tensors and names (create, publish, reshape, acquire, delete, free)
// and its lease counts. Its record store is record_store.cc, recovery recovery.cc, pool growth
// growth.cc and eviction catalog_eviction.cc.
#include "server/catalog/catalog.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/check.h"
#include "common/shm/fast_path_layout.h"
#include "common/shm/tensor_record.h"
#include "common/tensor/dtype.h"
#include "common/tensor/layout.h"
#include "common/tensor/name.h"
#include "server/ops/log.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {
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
  absl::StatusOr<HostPool> pool = HostPool::Create(HostPoolOptionsOf(options), &catalog->control_);
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
  if (tensor.ready_event.size() == sizeof(record.ready_event)) {
    std::memcpy(record.ready_event, tensor.ready_event.data(), sizeof(record.ready_event));
  }
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
