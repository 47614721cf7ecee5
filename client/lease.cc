#include "client/lease.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/fork.h"
#include "client/interop.h"
#include "client/public_status.h"
#include "common/tensor/wire.h"

namespace tensorshm {

alignas(256) const char kEmptyData[256] = {};

namespace {

void ReleaseLease(Lease* lease) noexcept {
  {
    MutexLock lock(&lease->event_mu);
    // A forked child leaves the driver alone (the event is the parent's business).
    if (const CudaBytes* cuda = lease->cuda();
        cuda != nullptr && lease->opened_event != nullptr && !lease->core->forked()) {
      lease->core->cuda().CloseEvent(cuda->ordinal, cuda->ready_event, lease->opened_event,
                                     lease->own_event);
    }
  }
  if (lease->core->forked()) {
    // The lease is the parent's: the child only lets go of its own copy of the tensor.
    KeepForever(std::move(lease->core));
  } else {
    lease->GiveBack();
  }
  delete lease;
}

}  // namespace

void Lease::GiveBack() noexcept {
  if (const PageLease* page = std::get_if<PageLease>(&held)) {
    core->ReleasePageLease(*page->fast, page->slot);
  } else {
    core->QueueRelease(std::get<RpcLease>(held).key);
  }
}

void DeleteVersioned(DLManagedTensorVersioned* self) noexcept {
  if (self != nullptr) ReleaseLease(static_cast<Lease*>(self->manager_ctx));
}

void DeleteLegacy(DLManagedTensor* self) noexcept {
  if (self != nullptr) ReleaseLease(static_cast<Lease*>(self->manager_ctx));
}

absl::StatusOr<SegmentPlace> HostPlace(ClientCore& core, const SegmentKey& key,
                                       const std::string& shm_name, const char* segment,
                                       uint64_t segment_size, const char* buffer) {
  if (!core.segments().Holds(key)) {
    return absl::FailedPreconditionError(
        absl::StrCat(SegmentLabel(key),
                     " is no longer tensorshmd's: the daemon restarted without it (get the tensor, "
                     "or create the buffer, again)"));
  }
  SegmentPlace place;
  place.segment_instance = key.first;
  place.segment_id = key.second;
  place.segment_size = segment_size;
  place.offset = static_cast<uint64_t>(buffer - segment);
  place.length = segment_size - place.offset;
  place.address = buffer;
  place.shm_name = shm_name;
  return place;
}

SegmentPlace PlaceFrom(const v1::Location& location, const char* address) {
  SegmentPlace place;
  place.segment_instance = location.segment_instance();
  place.segment_id = location.segment_id();
  place.segment_size = location.segment_size();
  place.offset = location.offset();
  place.length = location.length() == 0 ? 0 : location.segment_size() - location.offset();
  place.address = address;
  place.cuda_ipc_handle = location.cuda().ipc_handle();
  return place;
}

absl::StatusOr<CudaBuffer> OpenCudaLocation(ClientCore& core, const v1::Location& location) {
  const v1::CudaLocation& cuda = location.cuda();
  absl::StatusOr<int> ordinal = core.cuda().OrdinalOf(cuda.device_uuid());
  if (!ordinal.ok()) return ordinal.status();
  CudaBuffer buffer{*ordinal, nullptr};
  if (location.length() > 0) {
    absl::StatusOr<CUdeviceptr> base =
        cuda.vmm() ? core.mappings().CudaSegment(*ordinal, location)
                   : core.cuda().OpenSegment(
                         *ordinal, SegmentKey{location.segment_instance(), location.segment_id()},
                         location.segment_size(), cuda.ipc_handle());
    if (!base.ok()) return base.status();
    buffer.data = reinterpret_cast<char*>(*base + location.offset());
  }
  return buffer;
}

// Points `lease`'s DLPack structs at `data` with its shape and strides.
void FillTensor(Lease& lease, const char* data, DLDevice device, DLDataType dtype,
                uint64_t byte_offset, uint64_t flags) {
  DLTensor tensor{};
  tensor.data = const_cast<char*>(data);
  tensor.device = device;
  tensor.ndim = static_cast<int32_t>(lease.shape.size());
  tensor.dtype = dtype;
  tensor.shape = lease.shape.data();
  tensor.strides = lease.strides.data();
  tensor.byte_offset = byte_offset;
  lease.versioned.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  lease.versioned.manager_ctx = &lease;
  lease.versioned.flags = DLPACK_FLAG_BITMASK_READ_ONLY | flags;
  lease.versioned.dl_tensor = tensor;
  lease.legacy.manager_ctx = &lease;
  lease.legacy.dl_tensor = tensor;
}

// Builds the tensor for a lease the daemon granted. On failure the lease is given back.
absl::StatusOr<std::unique_ptr<Lease>> MakeLease(const std::shared_ptr<ClientCore>& core,
                                                 const v1::AcquireResponse& response) {
  auto lease = std::make_unique<Lease>();
  lease->core = core;
  // From here a failure must still give the lease back.
  lease->held = RpcLease{core->AddLease(response.tensor_id(), response.lease_id())};
  auto give_back = [&](absl::Status status) {
    lease->GiveBack();
    return status;
  };
  absl::StatusOr<DecodedTensor> decoded = DecodeDescriptor(response.desc(), response.location());
  if (!decoded.ok()) {
    return give_back(absl::InternalError(
        absl::StrCat("tensorshmd sent a bad descriptor: ", decoded.status().message())));
  }
  const v1::Location& location = response.location();
  const char* data = kEmptyData;
  if (decoded->device.device_type == kDLCUDA && location.has_cuda()) {
    absl::StatusOr<CudaBuffer> buffer = OpenCudaLocation(*core, location);
    if (!buffer.ok()) return give_back(buffer.status());
    decoded->device.device_id = buffer->ordinal;
    data = buffer->data;
    lease->bytes =
        CudaBytes{PlaceFrom(location, data), buffer->ordinal, location.cuda().ready_event()};
  } else if (decoded->device.device_type != kDLCPU ||
             (!location.has_host() && location.length() > 0)) {
    return give_back(absl::UnimplementedError(
        absl::StrCat("device = ", DeviceName(decoded->device), ": not supported by this client")));
  } else if (location.length() > 0) {
    absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping =
        core->mappings().HostSegment(SegmentKey{location.segment_instance(), location.segment_id()},
                                     location.segment_size(), location.offset(), location.length());
    if (!mapping.ok()) return give_back(mapping.status());
    data = (*mapping)->address() + location.offset();
    lease->bytes = HostBytes{*std::move(mapping)};
  }
  lease->shape = std::move(decoded->shape);
  lease->strides = std::move(decoded->strides);
  FillTensor(*lease, data, decoded->device, decoded->dtype, decoded->byte_offset, decoded->flags);
  return lease;
}

// Builds the tensor for a lease slot the fast path took, from what TryAcquire copied out of the
// record. On failure the slot is given back (the caller then asks the daemon).
absl::StatusOr<std::unique_ptr<Lease>> MakePageLease(const std::shared_ptr<ClientCore>& core,
                                                     std::shared_ptr<FastPath> fast,
                                                     FastPath::Leased& leased) {
  auto lease = std::make_unique<Lease>();
  lease->core = core;
  lease->held = PageLease{std::move(fast), leased.page_slot};
  core->PageLeaseTaken();
  const char* data = kEmptyData;
  DLDevice device{kDLCPU, 0};
  if (!leased.device_uuid.empty()) {
    // A CUDA tensor in a segment this process maps already; one it does not is the daemon's to
    // describe (the caller asks it, and the segment is mapped for the next time).
    const SegmentKey key{leased.segment_instance, leased.segment_id};
    const uint64_t end = leased.offset + leased.length;  // no overflow: TryAcquire checked
    absl::StatusOr<int> ordinal = core->cuda().OrdinalOf(leased.device_uuid);
    CudaState::Mapped mapped;
    if (!ordinal.ok() || !core->cuda().FindMapped(*ordinal, key, &mapped) || mapped.size < end) {
      lease->GiveBack();
      return absl::FailedPreconditionError(
          absl::StrCat("cuda segment ", key.second, ": not mapped here yet"));
    }
    data = reinterpret_cast<const char*>(mapped.base + leased.offset);
    device = DLDevice{kDLCUDA, *ordinal};
    CudaBytes& cuda = lease->bytes.emplace<CudaBytes>();
    cuda.ordinal = *ordinal;
    cuda.ready_event = std::move(leased.ready_event);
    SegmentPlace& place = cuda.place;
    place.segment_instance = key.first;
    place.segment_id = key.second;
    place.segment_size = mapped.size;
    place.offset = leased.offset;
    place.length = mapped.size - leased.offset;
    place.address = data;
    place.cuda_ipc_handle = std::move(mapped.ipc_handle);
  } else if (leased.length > 0) {
    // The mapping covers what the daemon says the segment holds; the record's byte range must
    // lie inside it (Mappings::HostSegment refuses a segment smaller than `end`).
    const uint64_t end = leased.offset + leased.length;  // no overflow: TryAcquire checked
    absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping = core->mappings().HostSegment(
        SegmentKey{leased.segment_instance, leased.segment_id}, end, leased.offset, leased.length);
    if (mapping.ok() && (*mapping)->size() < end) {
      mapping = absl::FailedPreconditionError("the record's range is outside its segment");
    }
    if (!mapping.ok()) {
      lease->GiveBack();
      return mapping.status();
    }
    data = (*mapping)->address() + leased.offset;
    lease->bytes = HostBytes{*std::move(mapping)};
  }
  RecordLayout& layout = leased.layout;
  lease->shape = std::move(layout.shape);
  lease->strides = std::move(layout.layout.strides);
  FillTensor(*lease, data, device, layout.dtype, layout.layout.byte_offset,
             layout.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0);
  return lease;
}

// Waits for `lease`'s ready event as `sync` says.
absl::Status WaitLeaseReady(const Lease& lease, ReadySync sync) {
  const CudaBytes* cuda = lease.cuda();
  if (cuda == nullptr || cuda->ready_event.empty() || sync.mode == ReadySync::Mode::kNone) {
    return absl::OkStatus();
  }
  return lease.core->cuda().WaitReady(cuda->ordinal, cuda->ready_event,
                                      sync.mode == ReadySync::Mode::kHost,
                                      static_cast<CUstream>(sync.stream));
}

absl::Status CopyToHost(const DLManagedTensorVersioned* tensor, const void* src, void* dst,
                        size_t bytes) {
  const Lease* lease = tensor != nullptr && tensor->deleter == DeleteVersioned
                           ? static_cast<const Lease*>(tensor->manager_ctx)
                           : nullptr;
  const CudaBytes* cuda = lease != nullptr ? lease->cuda() : nullptr;
  if (cuda == nullptr) {
    return absl::InvalidArgumentError("tensor: not a CUDA tensor acquired from a tensorshm Client");
  }
  if (absl::Status s = WaitLeaseReady(*lease, ReadySync::Host()); !s.ok()) return s;
  return lease->core->cuda().CopyDeviceToHost(cuda->ordinal, dst,
                                              reinterpret_cast<CUdeviceptr>(src), bytes);
}

absl::Status LeaseStatusOf(const DLManagedTensorVersioned* tensor) {
  if (tensor == nullptr || tensor->deleter != DeleteVersioned) {
    return absl::InvalidArgumentError("tensor: not acquired from a tensorshm Client");
  }
  const auto& lease = *static_cast<const Lease*>(tensor->manager_ctx);
  if (absl::Status s = lease.core->CheckProcess(); !s.ok()) return s;
  if (const PageLease* page = std::get_if<PageLease>(&lease.held)) {
    return lease.core->PageLeaseStatus(*page->fast, page->slot);
  }
  return lease.core->LeaseStatus(std::get<RpcLease>(lease.held).key);
}

Status LeaseStatus(const DLManagedTensorVersioned* tensor) {
  return ToPublic(LeaseStatusOf(tensor));
}

absl::StatusOr<const void*> ReadyEvent(const DLManagedTensorVersioned* tensor) {
  if (tensor == nullptr || tensor->deleter != DeleteVersioned) {
    return absl::InvalidArgumentError("tensor: not acquired from a tensorshm Client");
  }
  auto& lease = *static_cast<Lease*>(tensor->manager_ctx);
  const CudaBytes* cuda = lease.cuda();
  if (cuda == nullptr || cuda->ready_event.empty()) return nullptr;
  MutexLock lock(&lease.event_mu);
  if (lease.opened_event == nullptr) {
    bool own = false;
    absl::StatusOr<CUevent> event =
        lease.core->cuda().OpenEvent(cuda->ordinal, cuda->ready_event, &own);
    if (absl::IsNotFound(event.status())) return nullptr;  // its producer has ended
    if (!event.ok()) return event.status();
    lease.opened_event = *event;
    lease.own_event = own;
  }
  return static_cast<const void*>(&lease.opened_event);
}

absl::StatusOr<SegmentPlace> PlaceOf(const DLManagedTensorVersioned* tensor) {
  if (tensor == nullptr || tensor->deleter != DeleteVersioned) {
    return absl::InvalidArgumentError("tensor: not acquired from a tensorshm Client");
  }
  const Lease& lease = *static_cast<const Lease*>(tensor->manager_ctx);
  if (const CudaBytes* cuda = lease.cuda()) return cuda->place;
  const std::shared_ptr<const SegmentMapping>& mapping = std::get<HostBytes>(lease.bytes).mapping;
  if (mapping == nullptr) return SegmentPlace{};  // empty (length 0)
  const auto* data = static_cast<const char*>(tensor->dl_tensor.data);
  return HostPlace(*lease.core, mapping->key(), mapping->shm_name(), mapping->address(),
                   mapping->size(), data);
}

absl::Status WaitReadyOf(const DLManagedTensorVersioned* tensor, ReadySync sync) {
  if (tensor == nullptr || tensor->deleter != DeleteVersioned) {
    return absl::InvalidArgumentError("tensor: not acquired from a tensorshm Client");
  }
  return WaitLeaseReady(*static_cast<const Lease*>(tensor->manager_ctx), sync);
}

Status WaitReady(const DLManagedTensorVersioned* tensor, ReadySync sync) {
  return ToPublic(WaitReadyOf(tensor, sync));
}

}  // namespace tensorshm
