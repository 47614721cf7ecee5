#include "copy_in.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/interop.h"
#include "client/public_status.h"
#include "common/tensor/dtype.h"
#include "common/tensor/layout.h"
#include "common/tensor/wire.h"

namespace tensorshm::python {
namespace {

// Copies the elements of an n-d strided array into contiguous `out`, row by row: a whole inner
// row at once when it is contiguous.
void CopyStrided(const char* element0, const int64_t* shape, const int64_t* strides, int ndim,
                 int64_t item, char*& out) {
  if (ndim == 0) {
    std::memcpy(out, element0, item);
    out += item;
    return;
  }
  if (ndim == 1) {
    if (strides[0] == 1) {
      std::memcpy(out, element0, shape[0] * item);
      out += shape[0] * item;
    } else {
      for (int64_t i = 0; i < shape[0]; ++i, out += item) {
        std::memcpy(out, element0 + i * strides[0] * item, item);
      }
    }
    return;
  }
  for (int64_t i = 0; i < shape[0]; ++i) {
    CopyStrided(element0 + i * strides[0] * item, shape + 1, strides + 1, ndim - 1, item, out);
  }
}

// Copies `n` contiguous bytes. A large copy is split over a few threads: one core's memcpy does
// not reach the machine's memory bandwidth (Ray's object store copies large puts the same way).
void CopyContiguous(char* out, const char* in, size_t n) {
  constexpr size_t kParallelFrom = size_t{8} << 20;
  constexpr size_t kChunkAtLeast = size_t{4} << 20;
  constexpr unsigned kMaxThreads = 4;
  // Asked once per process: glibc reads /sys/devices/system/cpu/online each time.
  static const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t parts = std::min<size_t>({cores, kMaxThreads, n / kChunkAtLeast});
  if (n < kParallelFrom || parts < 2) {
    std::memcpy(out, in, n);
    return;
  }
  const size_t chunk = (n / parts + 4095) / 4096 * 4096;  // whole pages each
  std::vector<std::thread> helpers;
  helpers.reserve(parts - 1);
  for (size_t i = 1; i < parts; ++i) {
    const size_t begin = std::min(n, i * chunk);
    const size_t end = i + 1 == parts ? n : std::min(n, (i + 1) * chunk);
    if (begin < end) {
      helpers.emplace_back([=] { std::memcpy(out + begin, in + begin, end - begin); });
    }
  }
  std::memcpy(out, in, std::min(n, chunk));
  for (std::thread& helper : helpers) helper.join();
}

}  // namespace

tensorshm::StatusOr<WritableTensor> CopyIn(Client& client, const DLTensor& source, uint64_t flags,
                                           CudaStream stream, absl::Duration timeout,
                                           const WaitCanceller* cancel) {
  const bool cuda = source.device.device_type == kDLCUDA;
  if (source.device.device_type != kDLCPU && source.device.device_type != kDLCUDAHost && !cuda) {
    return ToPublic(absl::FailedPreconditionError(absl::StrCat(
        "device = ", DeviceName(source.device), ": only CPU and CUDA tensors can be put")));
  }
  absl::StatusOr<DLDataType> dtype =
      MakeDataType(source.dtype.code, source.dtype.bits, source.dtype.lanes);
  if (!dtype.ok()) return ToPublic(dtype.status());
  const bool padded = (flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
  TensorSpec spec;
  spec.dtype = *dtype;
  spec.shape.assign(source.shape, source.shape + source.ndim);
  spec.subbyte_padded = padded && IsSubByte(*dtype);
  std::vector<int64_t> strides =
      source.strides != nullptr ? std::vector<int64_t>(source.strides, source.strides + source.ndim)
                                : ContiguousStrides(spec.shape);
  // The source's layout must itself be valid (this also bounds every stride product).
  absl::StatusOr<TensorLayout> layout =
      ComputeLayout(*dtype, spec.shape, strides, spec.subbyte_padded);
  if (!layout.ok()) return ToPublic(layout.status());
  if (cuda) {
    if (strides != ContiguousStrides(spec.shape)) {
      return ToPublic(absl::UnimplementedError(
          absl::StrCat("strides = [", absl::StrJoin(strides, ","),
                       "]: only C-contiguous CUDA tensors can be put; make it contiguous first")));
    }
    spec.device = source.device;
  }
  tensorshm::StatusOr<WritableTensor> tensor = cancel != nullptr
                                                   ? client.Create(spec, ToChrono(timeout), *cancel)
                                                   : client.Create(spec, ToChrono(timeout));
  if (!tensor.ok()) return tensor.status();
  if (tensor->nbytes() == 0) return tensor;
  if (cuda) {
    const char* from = static_cast<const char*>(source.data) + source.byte_offset;
    if (absl::Status s = CopyOnDevice(client, source.device.device_id, tensor->data(), from,
                                      static_cast<size_t>(tensor->nbytes()), stream);
        !s.ok()) {
      return ToPublic(s);
    }
    return tensor;
  }
  const char* element0 = static_cast<const char*>(source.data) + source.byte_offset;
  char* out = static_cast<char*>(tensor->data());
  if (IsSubByte(*dtype) && !spec.subbyte_padded) {
    std::memcpy(out, element0, tensor->nbytes());  // packed: contiguous (checked by the layout)
  } else if (strides == ContiguousStrides(spec.shape)) {
    CopyContiguous(out, element0, static_cast<size_t>(tensor->nbytes()));
  } else {
    const int64_t item = spec.subbyte_padded ? 1 : ElementBits(*dtype) / 8;
    CopyStrided(element0, source.shape, strides.data(), source.ndim, item, out);
  }
  return tensor;
}

}  // namespace tensorshm::python
