#include "common/tensor/layout.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tensor/dtype.h"

namespace tensorshm {
namespace {

std::string Dims(absl::Span<const int64_t> values) {
  return absl::StrCat("[", absl::StrJoin(values, ", "), "]");
}

absl::Status Overflow(absl::string_view what, absl::Span<const int64_t> shape,
                      absl::Span<const int64_t> strides) {
  std::string message = absl::StrCat(what, " overflows int64: shape = ", Dims(shape));
  if (!strides.empty()) absl::StrAppend(&message, ", strides = ", Dims(strides));
  return absl::InvalidArgumentError(message);
}

}  // namespace

std::vector<int64_t> ContiguousStrides(absl::Span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t step = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = step;
    step *= shape[i] > 0 ? shape[i] : 1;
  }
  return strides;
}

absl::StatusOr<TensorLayout> ComputeLayout(const DLDataType& dtype, absl::Span<const int64_t> shape,
                                           absl::Span<const int64_t> strides, bool subbyte_padded) {
  const int64_t ndim = static_cast<int64_t>(shape.size());
  if (ndim > kMaxDims) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape: ", ndim, " dimensions, at most ", kMaxDims, " allowed"));
  }
  for (int64_t i = 0; i < ndim; ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape[", i, "] = ", shape[i], ": dimensions must be >= 0"));
    }
  }
  if (!strides.empty() && static_cast<int64_t>(strides.size()) != ndim) {
    return absl::InvalidArgumentError(
        absl::StrCat("strides = ", Dims(strides), ": ", strides.size(), " values for ", ndim,
                     " dimensions (give one per dimension, or none)"));
  }

  TensorLayout layout;
  // Element count, checked for overflow even when another dimension is 0, so that a shape is
  // either valid or not regardless of its order.
  int64_t numel = 1;
  bool empty = false;
  for (int64_t d : shape) {
    if (d == 0) {
      empty = true;
      continue;
    }
    if (__builtin_mul_overflow(numel, d, &numel)) return Overflow("element count", shape, strides);
  }
  if (empty) numel = 0;

  const std::vector<int64_t> contiguous = ContiguousStrides(shape);
  if (subbyte_padded && !IsSubByte(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("subbyte_padded: dtype ", DataTypeName(dtype), " is not a sub-byte type"));
  }
  if (IsSubByte(dtype) && !subbyte_padded) {
    if (!strides.empty() && !empty) {
      for (int64_t i = 0; i < ndim; ++i) {
        if (shape[i] > 1 && strides[i] != contiguous[i]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "strides = ", Dims(strides), ": dtype ", DataTypeName(dtype),
              " is packed below one byte per element and must be C-contiguous (strides ",
              Dims(contiguous), ")"));
        }
      }
    }
    layout.strides = contiguous;
    int64_t bits;
    if (__builtin_mul_overflow(numel, ElementBits(dtype), &bits)) {
      return Overflow("size in bits", shape, strides);
    }
    layout.nbytes = bits / 8 + (bits % 8 != 0 ? 1 : 0);
    return layout;
  }

  const int64_t item_bytes = subbyte_padded ? 1 : ElementBits(dtype) / 8;
  layout.strides =
      strides.empty() ? contiguous : std::vector<int64_t>(strides.begin(), strides.end());
  if (empty) return layout;

  // Elements reachable from [0, ..., 0]: [low, high], in elements.
  int64_t low = 0;
  int64_t high = 0;
  for (int64_t i = 0; i < ndim; ++i) {
    int64_t reach;
    if (__builtin_mul_overflow(shape[i] - 1, layout.strides[i], &reach)) {
      return Overflow("stride extent", shape, strides);
    }
    int64_t& bound = reach < 0 ? low : high;
    if (__builtin_add_overflow(bound, reach, &bound)) {
      return Overflow("stride extent", shape, strides);
    }
  }
  int64_t span_elements;
  if (__builtin_sub_overflow(high, low, &span_elements) ||
      __builtin_add_overflow(span_elements, 1, &span_elements) ||
      __builtin_mul_overflow(span_elements, item_bytes, &layout.nbytes)) {
    return Overflow("byte extent", shape, strides);
  }
  int64_t offset;
  if (__builtin_mul_overflow(low, -item_bytes, &offset)) {
    return Overflow("byte offset", shape, strides);
  }
  // Zero (broadcast) strides let a small buffer describe many elements: shape [2^40] with stride
  // 0 spans one element. What it describes is what consumers size and what a copy allocates
  // (numpy's nbytes, torch's numel x element size, the buffer protocol's len): that must fit
  // int64 too, or their arithmetic wraps.
  int64_t logical_bytes;
  if (__builtin_mul_overflow(numel, item_bytes, &logical_bytes)) {
    return Overflow("logical size (element count x element size)", shape, strides);
  }
  layout.byte_offset = static_cast<uint64_t>(offset);
  return layout;
}

std::string DeviceName(const DLDevice& device) {
  switch (device.device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return absl::StrCat("cuda:", device.device_id);
    default:
      return absl::StrCat("device(type=", static_cast<int>(device.device_type),
                          ",id=", device.device_id, ")");
  }
}

}  // namespace tensorshm
