#include "client/cuda_state.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tensorshm {

CudaState::~CudaState() {
  MutexLock lock(&mu_);
  if (driver_ == nullptr) return;
  for (const auto& [key, base] : segments_) {
    ScopedContext scope(driver_, contexts_.at(key.first));
    driver_->cuIpcCloseMemHandle(base);
  }
  for (const auto& [handle, ready] : events_) {
    ScopedContext scope(driver_, contexts_.at(ready.ordinal));
    driver_->cuEventDestroy_v2(ready.event);
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
                                                   const std::string& handle) {
  CUipcMemHandle ipc;
  if (handle.size() != sizeof(ipc.reserved)) {
    return absl::InvalidArgumentError(absl::StrCat("ipc_handle: ", handle.size(), " bytes; a ",
                                                   "CUipcMemHandle has ", sizeof(ipc.reserved)));
  }
  std::memcpy(ipc.reserved, handle.data(), sizeof(ipc.reserved));
  return InContext(ordinal,
                   [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<CUdeviceptr> {
                     if (auto it = segments_.find({ordinal, key}); it != segments_.end())
                       return it->second;
                     CUdeviceptr base;
                     if (absl::Status s = TSM_CU(driver_, ordinal, cuIpcOpenMemHandle_v2, &base,
                                                 ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
                         !s.ok()) {
                       return s;
                     }
                     segments_.emplace(std::make_pair(ordinal, key), base);
                     return base;
                   });
}

absl::StatusOr<std::string> CudaState::RecordReadyEvent(int ordinal, CUstream stream,
                                                        uint64_t tensor_id) {
  return InContext(
      ordinal, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<std::string> {
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
    ScopedContext scope(driver_, contexts_.at(ready.ordinal));
    driver_->cuEventDestroy_v2(ready.event);
    it = events_.erase(it);
    ++destroyed;
  }
  events_after_sweep_ = events_.size();
  return destroyed;
}

absl::Status CudaState::WaitReady(int ordinal, const std::string& handle, bool host_wait,
                                  CUstream stream) {
  const CudaDriver* driver;
  CUcontext context;
  CUevent own = nullptr;
  {
    MutexLock lock(&mu_);
    if (absl::Status s = Load(); !s.ok()) return s;
    absl::StatusOr<CUcontext> retained = Context(ordinal);
    if (!retained.ok()) return retained.status();
    driver = driver_;
    context = *retained;
    if (auto it = events_.find(handle); it != events_.end()) {
      own = it->second.event;
      ++it->second.waits;  // a sweep leaves it alone until the wait is done
    }
  }
  if (own != nullptr) {
    // Recorded by this process: waited on as it is.
    absl::Status status;
    {
      ScopedContext scope(driver, context);
      status = !scope.status().ok()
                   ? scope.status()
                   : (host_wait ? TSM_CU(driver, ordinal, cuEventSynchronize, own)
                                : TSM_CU(driver, ordinal, cuStreamWaitEvent, stream, own, 0));
    }
    MutexLock lock(&mu_);
    if (auto it = events_.find(handle); it != events_.end()) --it->second.waits;
    return status;
  }
  CUipcEventHandle ipc;
  if (handle.size() != sizeof(ipc.reserved)) {
    return absl::InvalidArgumentError(absl::StrCat("ready_event: ", handle.size(), " bytes; a ",
                                                   "CUipcEventHandle has ", sizeof(ipc.reserved)));
  }
  std::memcpy(ipc.reserved, handle.data(), sizeof(ipc.reserved));
  // Opened for this one wait: the destroy is deferred by CUDA until the wait is done.
  ScopedContext scope(driver, context);
  if (!scope.status().ok()) return scope.status();
  CUevent event;
  if (absl::Status s = TSM_CU(driver, ordinal, cuIpcOpenEventHandle, &event, ipc); !s.ok()) {
    return s;
  }
  absl::Status status = host_wait ? TSM_CU(driver, ordinal, cuEventSynchronize, event)
                                  : TSM_CU(driver, ordinal, cuStreamWaitEvent, stream, event, 0);
  driver->cuEventDestroy_v2(event);
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
    CUipcEventHandle ipc;
    if (handle.size() != sizeof(ipc.reserved)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ready_event: ", handle.size(), " bytes; a CUipcEventHandle has ", sizeof(ipc.reserved)));
    }
    std::memcpy(ipc.reserved, handle.data(), sizeof(ipc.reserved));
    CUevent event;
    if (absl::Status s = TSM_CU(driver_, ordinal, cuIpcOpenEventHandle, &event, ipc); !s.ok()) {
      return s;
    }
    *own = false;
    return event;
  });
}

void CudaState::CloseEvent(int ordinal, const std::string& handle, CUevent event, bool own) {
  MutexLock lock(&mu_);
  if (own) {
    if (auto it = events_.find(handle); it != events_.end()) --it->second.waits;
    return;
  }
  if (driver_ == nullptr) return;
  if (auto context = contexts_.find(ordinal); context != contexts_.end()) {
    ScopedContext scope(driver_, context->second);
    driver_->cuEventDestroy_v2(event);
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
