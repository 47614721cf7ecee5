#include "client/cuda_state.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tensorshm {

CudaState::~CudaState() {
  MutexLock lock(&mu_);
  if (driver_ == nullptr) return;
  for (const auto& [key, segment] : segments_) {
    ScopedContext scope(driver_, contexts_.at(key.first));
    driver_->cuIpcCloseMemHandle(segment.base);
  }
  for (const auto& [key, segment] : vmm_segments_) {
    ScopedContext scope(driver_, contexts_.at(key.first));
    for (uint64_t at = 0; at < segment.size; at += segment.piece) {
      driver_->cuMemUnmap(segment.base + at, std::min(segment.piece, segment.size - at));
    }
    driver_->cuMemAddressFree(segment.base, segment.size);
  }
  for (const auto& [handle, ready] : events_) {
    ScopedContext scope(driver_, contexts_.at(ready.ordinal));
    driver_->cuEventDestroy_v2(ready.event);
  }
  for (const auto& [key, event] : free_events_) {
    ScopedContext scope(driver_, contexts_.at(key.first));
    driver_->cuEventDestroy_v2(event);
  }
  for (const auto& [handle, opened] : opened_events_) {
    ScopedContext scope(driver_, contexts_.at(opened.ordinal));
    driver_->cuEventDestroy_v2(opened.event);
  }
  for (const auto& [ordinal, context] : contexts_) {
    CUdevice device;
    if (driver_->cuDeviceGet(&device, ordinal) == CUDA_SUCCESS) {
      driver_->cuDevicePrimaryCtxRelease_v2(device);
    }
  }
}

absl::Status CudaState::Load() {
  if (driver_ != nullptr) return absl::OkStatus();
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  absl::StatusOr<int> count = (*driver)->DeviceCount();
  if (!count.ok()) return count.status();
  std::vector<DeviceUuid> uuids;
  for (int ordinal = 0; ordinal < *count; ++ordinal) {
    absl::StatusOr<DeviceUuid> uuid = (*driver)->Uuid(ordinal);
    if (!uuid.ok()) return uuid.status();
    uuids.push_back(*uuid);
  }
  uuids_ = std::move(uuids);
  driver_ = *driver;
  return absl::OkStatus();
}

absl::StatusOr<CUcontext> CudaState::Context(int ordinal) {
  if (auto it = contexts_.find(ordinal); it != contexts_.end()) return it->second;
  CUdevice device;
  if (absl::Status s = TSM_CU(driver_, ordinal, cuDeviceGet, &device, ordinal); !s.ok()) return s;
  CUcontext context;
  if (absl::Status s = TSM_CU(driver_, ordinal, cuDevicePrimaryCtxRetain, &context, device);
      !s.ok()) {
    return s;
  }
  contexts_.emplace(ordinal, context);
  return context;
}

template <typename Fn>
auto CudaState::InContext(int ordinal, Fn&& fn) {
  using Result = decltype(fn());
  MutexLock lock(&mu_);
  if (absl::Status s = Load(); !s.ok()) return Result(s);
  absl::StatusOr<CUcontext> context = Context(ordinal);
  if (!context.ok()) return Result(context.status());
  ScopedContext scope(driver_, *context);
  if (!scope.status().ok()) return Result(scope.status());
  return fn();
}

absl::StatusOr<int> CudaState::OrdinalOf(const std::string& uuid) {
  MutexLock lock(&mu_);
  if (absl::Status s = Load(); !s.ok()) return s;
  DeviceUuid wanted{};
  if (uuid.size() != wanted.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_uuid: ", uuid.size(), " bytes; a CUDA UUID has 16"));
  }
  std::memcpy(wanted.data(), uuid.data(), wanted.size());
  for (size_t ordinal = 0; ordinal < uuids_.size(); ++ordinal) {
    if (uuids_[ordinal] == wanted) return static_cast<int>(ordinal);
  }
  return absl::FailedPreconditionError(
      absl::StrCat("device ", FormatUuid(wanted), " is not visible to this process (",
                   uuids_.size(), " CUDA devices visible; check CUDA_VISIBLE_DEVICES)"));
}

absl::StatusOr<std::string> CudaState::UuidOf(int ordinal) {
  MutexLock lock(&mu_);
  if (absl::Status s = Load(); !s.ok()) return s;
  if (ordinal < 0 || ordinal >= static_cast<int>(uuids_.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device = cuda:", ordinal, ": this process sees ", uuids_.size(), " CUDA devices"));
  }
  return std::string(reinterpret_cast<const char*>(uuids_[ordinal].data()), uuids_[ordinal].size());
}

absl::StatusOr<CUdeviceptr> CudaState::OpenSegment(int ordinal, const SegmentKey& key,
                                                   uint64_t size, const std::string& handle) {
  CUipcMemHandle ipc;
  if (handle.size() != sizeof(ipc.reserved)) {
    return absl::InvalidArgumentError(absl::StrCat("ipc_handle: ", handle.size(), " bytes; a ",
                                                   "CUipcMemHandle has ", sizeof(ipc.reserved)));
  }
  std::memcpy(ipc.reserved, handle.data(), sizeof(ipc.reserved));
  return InContext(ordinal,
                   [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<CUdeviceptr> {
                     if (auto it = segments_.find({ordinal, key}); it != segments_.end())
                       return it->second.base;
                     CUdeviceptr base;
                     if (absl::Status s = TSM_CU(driver_, ordinal, cuIpcOpenMemHandle_v2, &base,
                                                 ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
                         !s.ok()) {
                       return s;
                     }
                     segments_.emplace(std::make_pair(ordinal, key), Mapped{base, size, handle});
                     return base;
                   });
}

bool CudaState::FindMapped(int ordinal, const SegmentKey& key, Mapped* mapped) {
  MutexLock lock(&mu_);
  if (auto it = vmm_segments_.find({ordinal, key}); it != vmm_segments_.end()) {
    mapped->base = it->second.base;
    mapped->size = it->second.size;
    mapped->ipc_handle.clear();
    return true;
  }
  if (auto it = segments_.find({ordinal, key}); it != segments_.end()) {
    *mapped = it->second;
    return true;
  }
  return false;
}

absl::StatusOr<CUdeviceptr> CudaState::MapVmmSegment(int ordinal, const SegmentKey& key,
                                                     UniqueFd fd, uint64_t size,
                                                     uint64_t granularity) {
  return InContext(
      ordinal, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<CUdeviceptr> {
        SealCompleted();
        if (auto it = vmm_segments_.find({ordinal, key}); it != vmm_segments_.end()) {
          return it->second.base;
        }
        const std::string label = absl::StrCat("cuda segment ", key.second, " (instance ",
                                               key.first, ") of ", size, " bytes: ");
        auto named = [&](absl::Status s) {
          return absl::Status(s.code(), absl::StrCat(label, s.message()));
        };
        if (granularity == 0 || size == 0 || size % granularity != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(label, "not a multiple of the granularity (", granularity, " bytes)"));
        }
        CUmemGenericAllocationHandle handle;
        if (absl::Status s = TSM_CU(driver_, ordinal, cuMemImportFromShareableHandle, &handle,
                                    reinterpret_cast<void*>(static_cast<intptr_t>(fd.get())),
                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            !s.ok()) {
          return named(s);
        }
        fd.reset();  // the imported handle holds the memory
        VmmSegment segment;
        segment.size = size;
        const uint64_t granules = size / granularity;
        segment.piece = granularity * ((granules + kMaxVmmPieces - 1) / kMaxVmmPieces);
        segment.writers.assign((size + segment.piece - 1) / segment.piece, 0);
        absl::Status status =
            TSM_CU(driver_, ordinal, cuMemAddressReserve, &segment.base, size, granularity, 0, 0);
        uint64_t mapped = 0;
        while (status.ok() && mapped < size) {
          const uint64_t length = std::min(segment.piece, size - mapped);
          status =
              TSM_CU(driver_, ordinal, cuMemMap, segment.base + mapped, length, mapped, handle, 0);
          if (status.ok()) mapped += length;
        }
        // The mappings hold the memory from here on: the handle goes now.
        driver_->cuMemRelease(handle);
        if (status.ok()) {
          status =
              SetPieceAccess(ordinal, segment, 0, segment.writers.size() - 1, /*writable=*/false);
        }
        if (!status.ok()) {
          for (uint64_t at = 0; at < mapped; at += segment.piece) {
            driver_->cuMemUnmap(segment.base + at, std::min(segment.piece, mapped - at));
          }
          if (segment.base != 0) driver_->cuMemAddressFree(segment.base, size);
          return named(status);
        }
        const CUdeviceptr base = segment.base;
        vmm_segments_.emplace(std::make_pair(ordinal, key), std::move(segment));
        return base;
      });
}

absl::Status CudaState::SetPieceAccess(int ordinal, const VmmSegment& segment, uint64_t first,
                                       uint64_t last, bool writable) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = writable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
  const uint64_t begin = first * segment.piece;
  const uint64_t end = std::min((last + 1) * segment.piece, segment.size);
  return TSM_CU(driver_, ordinal, cuMemSetAccess, segment.base + begin, end - begin, &access, 1);
}

absl::Status CudaState::MakeWritable(int ordinal, const SegmentKey& key, uint64_t offset,
                                     uint64_t length) {
  return InContext(ordinal, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    SealCompleted();
    auto it = vmm_segments_.find({ordinal, key});
    if (it == vmm_segments_.end() || length == 0 || offset + length > it->second.size) {
      return absl::InternalError(absl::StrCat("cuda segment ", key.second, ": [", offset, ", +",
                                              length, ") is not in a mapped segment"));
    }
    VmmSegment& segment = it->second;
    const uint64_t first = offset / segment.piece;
    const uint64_t last = (offset + length - 1) / segment.piece;
    for (uint64_t piece = first; piece <= last; ++piece) {
      if (segment.writers[piece] == 0) {
        if (absl::Status s = SetPieceAccess(ordinal, segment, piece, piece, /*writable=*/true);
            !s.ok()) {
          // Undo the pieces made writable for this buffer.
          if (piece > first) {
            SealNow(ordinal, key, first * segment.piece, (piece - first) * segment.piece)
                .IgnoreError();
          }
          return s;
        }
      }
      ++segment.writers[piece];
    }
    return absl::OkStatus();
  });
}

absl::Status CudaState::SealNow(int ordinal, const SegmentKey& key, uint64_t offset,
                                uint64_t length) {
  auto it = vmm_segments_.find({ordinal, key});
  if (it == vmm_segments_.end()) return absl::OkStatus();
  VmmSegment& segment = it->second;
  absl::Status status;
  for (uint64_t piece = offset / segment.piece; piece <= (offset + length - 1) / segment.piece;
       ++piece) {
    if (segment.writers[piece] == 0) continue;
    if (--segment.writers[piece] == 0) {
      absl::Status s = SetPieceAccess(ordinal, segment, piece, piece, /*writable=*/false);
      if (status.ok()) status = s;
    }
  }
  return status;
}

absl::Status CudaState::Seal(int ordinal, const SegmentKey& key, uint64_t offset, uint64_t length,
                             const std::string& ready_event) {
  return InContext(ordinal, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (!ready_event.empty()) {
      if (auto event = events_.find(ready_event); event != events_.end()) {
        ++event->second.waits;  // no sweep destroys it while the seal waits for it
        pending_seals_.push_back(PendingSeal{ordinal, key, offset, length, ready_event});
        SealCompleted();
        return absl::OkStatus();
      }
    }
    return SealNow(ordinal, key, offset, length);
  });
}

void CudaState::SealCompleted() {
  for (auto pending = pending_seals_.begin(); pending != pending_seals_.end();) {
    auto event = events_.find(pending->ready_event);
    ScopedContext scope(driver_, contexts_.at(pending->ordinal));
    if (event != events_.end() &&
        driver_->cuEventQuery(event->second.event) == CUDA_ERROR_NOT_READY) {
      ++pending;
      continue;
    }
    // Completed (or failed: the stream's work is over either way).
    if (event != events_.end()) --event->second.waits;
    SealNow(pending->ordinal, pending->key, pending->offset, pending->length).IgnoreError();
    pending = pending_seals_.erase(pending);
  }
}

absl::StatusOr<std::string> CudaState::RecordReadyEvent(int ordinal, CUstream stream,
                                                        uint64_t tensor_id) {
  return InContext(
      ordinal, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<std::string> {
        SealCompleted();
        // An event of a freed tensor is recorded again: its handle, and the events other
        // processes opened from it, stay valid.
        for (auto free = free_events_.rbegin(); free != free_events_.rend(); ++free) {
          if (free->first.first != ordinal) continue;
          const CUevent event = free->second;
          std::string handle = free->first.second;
          free_events_.erase(std::next(free).base());
          if (absl::Status s = TSM_CU(driver_, ordinal, cuEventRecord, event, stream); !s.ok()) {
            driver_->cuEventDestroy_v2(event);
            return s;
          }
          events_[handle] = ReadyEvent{ordinal, event, tensor_id, next_event_serial_++, 0};
          return handle;
        }
        CUevent event;
        if (absl::Status s = TSM_CU(driver_, ordinal, cuEventCreate, &event,
                                    CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
            !s.ok()) {
          return s;
        }
        CUipcEventHandle ipc;
        absl::Status status = TSM_CU(driver_, ordinal, cuEventRecord, event, stream);
        if (status.ok()) status = TSM_CU(driver_, ordinal, cuIpcGetEventHandle, &ipc, event);
        if (!status.ok()) {
          driver_->cuEventDestroy_v2(event);
          return status;
        }
        std::string handle(ipc.reserved, sizeof(ipc.reserved));
        events_[handle] = ReadyEvent{ordinal, event, tensor_id, next_event_serial_++, 0};
        return handle;
      });
}

size_t CudaState::ready_event_count() const {
  MutexLock lock(&mu_);
  return events_.size();
}

int CudaState::SweepReadyEvents(
    size_t sweep_at, const std::function<void(std::vector<uint64_t>*)>& held_tensor_ids) {
  uint64_t before = 0;
  {
    MutexLock lock(&mu_);
    sweep_at = std::max({sweep_at, kMinReadyEventSweep, 2 * events_after_sweep_});
    if (sweeping_ || events_.size() < sweep_at) return 0;
    sweeping_ = true;
    before = next_event_serial_;
  }
  // Outside the lock: the scan reads every record of the daemon's catalog.
  std::vector<uint64_t> held;
  held_tensor_ids(&held);
  std::sort(held.begin(), held.end());
  MutexLock lock(&mu_);
  sweeping_ = false;
  int destroyed = 0;
  for (auto it = events_.begin(); it != events_.end();) {
    const ReadyEvent& ready = it->second;
    // An event recorded after the scan began may be for a tensor the scan did not see yet.
    if (ready.serial >= before || ready.waits > 0 ||
        std::binary_search(held.begin(), held.end(), ready.tensor_id)) {
      ++it;
      continue;
    }
    if (free_events_.size() < kMaxFreeEvents) {
      free_events_.push_back({{ready.ordinal, it->first}, ready.event});
    } else {
      ScopedContext scope(driver_, contexts_.at(ready.ordinal));
      driver_->cuEventDestroy_v2(ready.event);
    }
    it = events_.erase(it);
    ++destroyed;
  }
  events_after_sweep_ = events_.size();
  return destroyed;
}

absl::Status CudaState::WaitReady(int ordinal, const std::string& handle, bool host_wait,
                                  CUstream stream) {
  bool own = false;
  absl::StatusOr<CUevent> event = OpenEvent(ordinal, handle, &own);
  if (absl::IsNotFound(event.status())) return absl::OkStatus();  // its producer has ended
  if (!event.ok()) return event.status();
  absl::Status status;
  {
    const CudaDriver* driver;
    CUcontext context;
    {
      MutexLock lock(&mu_);
      driver = driver_;
      context = contexts_.at(ordinal);
    }
    // Outside the lock: a host wait may take as long as the producer's kernels.
    ScopedContext scope(driver, context);
    const CUresult done = driver->cuEventQuery(*event);
    if (!scope.status().ok()) {
      status = scope.status();
    } else if (done != CUDA_SUCCESS) {
      status = host_wait ? TSM_CU(driver, ordinal, cuEventSynchronize, *event)
                         : TSM_CU(driver, ordinal, cuStreamWaitEvent, stream, *event, 0);
    }
  }
  CloseEvent(ordinal, handle, *event, own);
  return status;
}

absl::StatusOr<CUevent> CudaState::OpenEvent(int ordinal, const std::string& handle, bool* own) {
  return InContext(ordinal, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<CUevent> {
    if (auto it = events_.find(handle); it != events_.end()) {
      // Recorded by this process (CUDA opens no IPC handle where it was exported): counted as a
      // wait in progress, so that no sweep destroys it while the caller keeps it.
      ++it->second.waits;
      *own = true;
      return it->second.event;
    }
    *own = false;
    if (auto it = opened_events_.find({ordinal, handle}); it != opened_events_.end()) {
      ++it->second.users;
      it->second.last_use = next_use_++;
      return it->second.event;
    }
    CUipcEventHandle ipc;
    if (handle.size() != sizeof(ipc.reserved)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ready_event: ", handle.size(), " bytes; a CUipcEventHandle has ", sizeof(ipc.reserved)));
    }
    std::memcpy(ipc.reserved, handle.data(), sizeof(ipc.reserved));
    CUevent event;
    if (absl::Status s = TSM_CU(driver_, ordinal, cuIpcOpenEventHandle, &event, ipc); !s.ok()) {
      // The process that recorded it has ended (its events went with it), and its device work
      // with it: there is nothing left to wait for.
      return absl::NotFoundError(absl::StrCat("ready_event: the producer's event is gone (",
                                              s.message(), "); its process has ended"));
    }
    opened_events_[{ordinal, handle}] = OpenedEvent{ordinal, event, 1, next_use_++};
    if (opened_events_.size() > kMaxOpenedEvents) TrimOpenedEvents();
    return event;
  });
}

void CudaState::TrimOpenedEvents() {
  std::vector<std::pair<uint64_t, std::pair<int, std::string>>> idle;
  for (const auto& [key, opened] : opened_events_) {
    if (opened.users == 0) idle.emplace_back(opened.last_use, key);
  }
  std::sort(idle.begin(), idle.end());
  const size_t keep = kMaxOpenedEvents * 3 / 4;
  for (size_t i = 0; i < idle.size() && opened_events_.size() > keep; ++i) {
    auto it = opened_events_.find(idle[i].second);
    ScopedContext scope(driver_, contexts_.at(it->second.ordinal));
    driver_->cuEventDestroy_v2(it->second.event);
    opened_events_.erase(it);
  }
}

void CudaState::CloseEvent(int ordinal, const std::string& handle, CUevent event, bool own) {
  MutexLock lock(&mu_);
  if (own) {
    if (auto it = events_.find(handle); it != events_.end()) --it->second.waits;
    return;
  }
  // Kept open for the next acquire of a tensor its producer recorded it for.
  if (auto it = opened_events_.find({ordinal, handle});
      it != opened_events_.end() && it->second.event == event) {
    --it->second.users;
  }
}

absl::Status CudaState::StreamWaitEvent(int ordinal, CUstream stream, CUevent event) {
  return InContext(ordinal, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return TSM_CU(driver_, ordinal, cuStreamWaitEvent, stream, event, 0);
  });
}

absl::Status CudaState::CopyDeviceToDevice(int ordinal, CUdeviceptr dst, CUdeviceptr src,
                                           size_t bytes, CUstream stream) {
  return InContext(ordinal, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return TSM_CU(driver_, ordinal, cuMemcpyDtoDAsync_v2, dst, src, bytes, stream);
  });
}

absl::Status CudaState::CopyDeviceToHost(int ordinal, void* dst, CUdeviceptr src, size_t bytes) {
  return InContext(ordinal, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return TSM_CU(driver_, ordinal, cuMemcpyDtoH_v2, dst, src, bytes);
  });
}

}  // namespace tensorshm
