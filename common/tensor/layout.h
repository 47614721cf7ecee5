// How a tensor's shape and strides map onto the bytes of its buffer.
#ifndef TENSORSHM_COMMON_TENSOR_LAYOUT_H_
#define TENSORSHM_COMMON_TENSOR_LAYOUT_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace tensorshm {

inline constexpr int kMaxDims = 32;

struct TensorLayout {
  // Strides in elements, one per dimension (C-contiguous ones when none were given).
  std::vector<int64_t> strides;
  // Bytes from the buffer's start to element [0, ..., 0]; non-zero only for negative strides.
  uint64_t byte_offset = 0;
  // Bytes of storage the tensor spans; 0 for a tensor with a zero dimension.
  int64_t nbytes = 0;
};

// Returns the layout of a tensor of `dtype` (already valid, see MakeDataType) with `shape` and
// `strides` (empty: C-contiguous). Sub-byte dtypes are packed, and must be C-contiguous, unless
// `subbyte_padded`: then every element takes one byte and any strides are fine (DLPack's
// IS_SUBBYTE_TYPE_PADDED). INVALID_ARGUMENT naming the field and value if ndim exceeds kMaxDims,
// a dimension is negative, the stride count differs from ndim, a packed sub-byte dtype has
// non-contiguous strides, `subbyte_padded` is set for a dtype of whole bytes, or the element
// count or byte extent overflows int64.
absl::StatusOr<TensorLayout> ComputeLayout(const DLDataType& dtype, absl::Span<const int64_t> shape,
                                           absl::Span<const int64_t> strides,
                                           bool subbyte_padded = false);

// C-contiguous strides, in elements, for `shape`. REQUIRES: shape valid per ComputeLayout.
std::vector<int64_t> ContiguousStrides(absl::Span<const int64_t> shape);

// A tensor as clients read it: its dtype, device, and where its elements lie in its buffer.
struct DecodedTensor {
  DLDataType dtype{};
  DLDevice device{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  uint64_t byte_offset = 0;
  int64_t nbytes = 0;
  uint64_t flags = 0;  // DLPack flags of the storage (IS_SUBBYTE_TYPE_PADDED or 0)
};

// "cpu", "cuda:1", or "device(type=..,id=..)".
std::string DeviceName(const DLDevice& device);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_TENSOR_LAYOUT_H_
