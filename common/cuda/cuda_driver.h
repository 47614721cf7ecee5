// The CUDA driver API, loaded with dlopen at run time and never linked, so that tensorshmd and
// libtensorshm run on machines without CUDA. TENSORSHM_LIBCUDA names another driver library
// (the tests' emulated driver).
#ifndef TENSORSHM_COMMON_CUDA_CUDA_DRIVER_H_
#define TENSORSHM_COMMON_CUDA_CUDA_DRIVER_H_

#include <cuda.h>

#include <array>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tensorshm {

// Every driver entry point tensorshm calls, by its versioned symbol name.
#define TSM_CUDA_FUNCTIONS(X)       \
  X(cuInit)                         \
  X(cuGetErrorName)                 \
  X(cuGetErrorString)               \
  X(cuDeviceGetCount)               \
  X(cuDeviceGet)                    \
  X(cuDeviceGetUuid_v2)             \
  X(cuDevicePrimaryCtxRetain)       \
  X(cuDevicePrimaryCtxRelease_v2)   \
  X(cuCtxPushCurrent_v2)            \
  X(cuCtxPopCurrent_v2)             \
  X(cuMemAlloc_v2)                  \
  X(cuMemFree_v2)                   \
  X(cuMemcpyHtoD_v2)                \
  X(cuMemcpyDtoH_v2)                \
  X(cuMemcpyDtoDAsync_v2)           \
  X(cuIpcGetMemHandle)              \
  X(cuIpcOpenMemHandle_v2)          \
  X(cuIpcCloseMemHandle)            \
  X(cuEventCreate)                  \
  X(cuEventRecord)                  \
  X(cuEventSynchronize)             \
  X(cuEventQuery)                   \
  X(cuEventDestroy_v2)              \
  X(cuIpcGetEventHandle)            \
  X(cuIpcOpenEventHandle)           \
  X(cuStreamWaitEvent)              \
  X(cuStreamSynchronize)            \
  X(cuStreamCreate)                 \
  X(cuStreamDestroy_v2)             \
  X(cuStreamQuery)                  \
  X(cuMemsetD8Async)                \
  X(cuMemsetD8_v2)                  \
  X(cuDeviceGetAttribute)           \
  X(cuMemGetAllocationGranularity)  \
  X(cuMemCreate)                    \
  X(cuMemRelease)                   \
  X(cuMemExportToShareableHandle)   \
  X(cuMemImportFromShareableHandle) \
  X(cuMemAddressReserve)            \
  X(cuMemAddressFree)               \
  X(cuMemMap)                       \
  X(cuMemUnmap)                     \
  X(cuMemSetAccess)

// A device UUID, as CUDA reports it and descriptors carry it.
using DeviceUuid = std::array<unsigned char, 16>;

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it.
std::string FormatUuid(const DeviceUuid& uuid);

class CudaDriver {
 public:
  // The process's driver: loaded (TENSORSHM_LIBCUDA, else libcuda.so.1) and cuInit(0)-ed on the
  // first call; later calls return the same one, or the same error. FAILED_PRECONDITION naming
  // the library and dlopen's / cuInit's error when there is no usable driver.
  static absl::StatusOr<const CudaDriver*> Get();

  // OK for CUDA_SUCCESS; otherwise INTERNAL (RESOURCE_EXHAUSTED for out-of-memory) naming the
  // call, the device (when >= 0) and the driver's error name and string.
  absl::Status Check(CUresult result, std::string_view call, int device = -1) const;

  // Number of devices, and the UUID of device `ordinal`.
  absl::StatusOr<int> DeviceCount() const;
  absl::StatusOr<DeviceUuid> Uuid(int ordinal) const;

  const std::string& library() const { return library_; }

#define TSM_CUDA_MEMBER(name) decltype(&::name) name = nullptr;
  TSM_CUDA_FUNCTIONS(TSM_CUDA_MEMBER)
#undef TSM_CUDA_MEMBER

 private:
  CudaDriver() = default;
  std::string library_;
};

// Calls a driver function through `driver` and checks its result: TSM_CU(driver, device,
// cuMemAlloc_v2, &ptr, size) is an absl::Status naming cuMemAlloc_v2 and the device.
#define TSM_CU(driver, device, fn, ...) (driver)->Check((driver)->fn(__VA_ARGS__), #fn, (device))

// Makes device `ordinal`'s primary context current on this thread for the scope (retained by the
// caller beforehand), restoring the previous one after.
class ScopedContext {
 public:
  ScopedContext(const CudaDriver* driver, CUcontext context);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  const CudaDriver* driver_;
  absl::Status status_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_CUDA_CUDA_DRIVER_H_
