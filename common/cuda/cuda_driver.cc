#include "common/cuda/cuda_driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tensorshm {

std::string FormatUuid(const DeviceUuid& uuid) {
  std::string hex;
  for (size_t i = 0; i < uuid.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) hex += '-';
    absl::StrAppendFormat(&hex, "%02x", uuid[i]);
  }
  return "GPU-" + hex;
}

absl::StatusOr<const CudaDriver*> CudaDriver::Get() {
  static const absl::StatusOr<const CudaDriver*>* const loaded =
      new absl::StatusOr<const CudaDriver*>([]() -> absl::StatusOr<const CudaDriver*> {
        const char* chosen = std::getenv("TENSORSHM_LIBCUDA");
        const std::string library = chosen != nullptr && *chosen != '\0' ? chosen : "libcuda.so.1";
        const std::string origin =
            chosen != nullptr && *chosen != '\0' ? " (TENSORSHM_LIBCUDA)" : "";
        // Never unloaded: tensors and cached handles may need it until the process exits.
        void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (handle == nullptr) {
          const char* error = dlerror();
          return absl::FailedPreconditionError(
              absl::StrCat("no CUDA driver: cannot load ", library, origin, ": ",
                           error != nullptr ? error : "unknown dlopen error"));
        }
        std::unique_ptr<CudaDriver> driver(new CudaDriver());
        driver->library_ = library;
#define TSM_CUDA_LOAD(name)                                                                     \
  driver->name = reinterpret_cast<decltype(&::name)>(dlsym(handle, #name));                     \
  if (driver->name == nullptr) {                                                                \
    return absl::FailedPreconditionError(                                                       \
        absl::StrCat("CUDA driver ", library, origin, " lacks ", #name, " (driver too old?)")); \
  }
        TSM_CUDA_FUNCTIONS(TSM_CUDA_LOAD)
#undef TSM_CUDA_LOAD
        if (absl::Status s = TSM_CU(driver.get(), -1, cuInit, 0); !s.ok()) {
          return absl::FailedPreconditionError(
              absl::StrCat("CUDA driver ", library, origin, " did not start: ", s.message()));
        }
        return driver.release();  // the process's driver, never freed
      }());
  return *loaded;
}

absl::Status CudaDriver::Check(CUresult result, std::string_view call, int device) const {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName == nullptr || cuGetErrorName(result, &name) != CUDA_SUCCESS) name = nullptr;
  if (cuGetErrorString == nullptr || cuGetErrorString(result, &text) != CUDA_SUCCESS) {
    text = nullptr;
  }
  std::string message = std::string(call);
  if (device >= 0) absl::StrAppend(&message, " on cuda:", device);
  absl::StrAppend(&message, ": ", name != nullptr ? name : absl::StrCat("CUresult ", result));
  if (text != nullptr) absl::StrAppend(&message, " (", text, ")");
  if (result == CUDA_ERROR_OUT_OF_MEMORY) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::StatusOr<int> CudaDriver::DeviceCount() const {
  int count = 0;
  if (absl::Status s = TSM_CU(this, -1, cuDeviceGetCount, &count); !s.ok()) return s;
  return count;
}

absl::StatusOr<DeviceUuid> CudaDriver::Uuid(int ordinal) const {
  CUdevice device;
  if (absl::Status s = TSM_CU(this, ordinal, cuDeviceGet, &device, ordinal); !s.ok()) return s;
  CUuuid uuid;
  if (absl::Status s = TSM_CU(this, ordinal, cuDeviceGetUuid_v2, &uuid, device); !s.ok()) return s;
  DeviceUuid result;
  for (size_t i = 0; i < result.size(); ++i) result[i] = static_cast<unsigned char>(uuid.bytes[i]);
  return result;
}

ScopedContext::ScopedContext(const CudaDriver* driver, CUcontext context) : driver_(driver) {
  status_ = TSM_CU(driver_, -1, cuCtxPushCurrent_v2, context);
}

ScopedContext::~ScopedContext() {
  if (!status_.ok()) return;
  CUcontext popped;
  driver_->cuCtxPopCurrent_v2(&popped);
}

}  // namespace tensorshm
