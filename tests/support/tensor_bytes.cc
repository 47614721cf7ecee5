#include "tests/support/tensor_bytes.h"

#include <vector>

#include "common/base/check.h"
#include "common/tensor/dtype.h"
#include "common/tensor/layout.h"

namespace tensorshm::testing {
namespace {

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

void Mix(uint64_t& hash, const unsigned char* bytes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    hash ^= bytes[i];
    hash *= kFnvPrime;
  }
}

TensorLayout LayoutOf(const DLTensor& tensor) {
  std::vector<int64_t> strides;
  if (tensor.strides != nullptr) strides.assign(tensor.strides, tensor.strides + tensor.ndim);
  absl::StatusOr<TensorLayout> layout =
      ComputeLayout(tensor.dtype, absl::MakeConstSpan(tensor.shape, tensor.ndim), strides);
  TSM_CHECK(layout.ok());
  return *layout;
}

}  // namespace

uint64_t StorageHash(const DLTensor& tensor) {
  const TensorLayout layout = LayoutOf(tensor);
  uint64_t hash = kFnvOffset;
  Mix(hash, static_cast<const unsigned char*>(tensor.data), layout.nbytes);
  return hash;
}

uint64_t LogicalHash(const DLTensor& tensor) {
  if (IsSubByte(tensor.dtype)) return StorageHash(tensor);
  const TensorLayout layout = LayoutOf(tensor);
  uint64_t hash = kFnvOffset;
  if (layout.nbytes == 0) return hash;
  const int64_t item = ElementBits(tensor.dtype) / 8;
  const auto* origin = static_cast<const unsigned char*>(tensor.data) + tensor.byte_offset;
  std::vector<int64_t> index(tensor.ndim, 0);
  while (true) {
    int64_t offset = 0;
    for (int d = 0; d < tensor.ndim; ++d) offset += index[d] * layout.strides[d];
    Mix(hash, origin + offset * item, item);
    int d = tensor.ndim - 1;
    while (d >= 0 && ++index[d] == tensor.shape[d]) index[d--] = 0;
    if (d < 0) break;
  }
  return hash;
}

}  // namespace tensorshm::testing
