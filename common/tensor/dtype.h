// DLPack data types: which (code, bits, lanes) combinations tensorshm accepts, their names, and
// their sizes. The one table of dtype knowledge for the daemon, the clients and the bindings.
#ifndef TENSORSHM_COMMON_TENSOR_DTYPE_H_
#define TENSORSHM_COMMON_TENSOR_DTYPE_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorshm {

// Returns the DLDataType for raw wire values if DLPack allows the combination and a tensor of it
// can live in shared memory. INVALID_ARGUMENT naming `field` and the values otherwise: unknown
// codes, bit widths the code does not have, lanes outside 1..65535, opaque handles (pointers do
// not cross processes), vectors of sub-byte types.
absl::StatusOr<DLDataType> MakeDataType(uint32_t code, uint32_t bits, uint32_t lanes,
                                        absl::string_view field = "dtype");

// Bits one element takes: bits * lanes.
inline int64_t ElementBits(const DLDataType& dtype) {
  return static_cast<int64_t>(dtype.bits) * dtype.lanes;
}

// True if elements are not a whole number of bytes (float4, float6, int4): such tensors are
// stored packed and must be C-contiguous.
inline bool IsSubByte(const DLDataType& dtype) { return ElementBits(dtype) % 8 != 0; }

// numpy / ml_dtypes style name: "float32", "bfloat16", "float8_e4m3fn", "bool", "complex64";
// vectors append "x<lanes>". Unknown combinations read "dtype(code=..,bits=..,lanes=..)".
std::string DataTypeName(const DLDataType& dtype);

// Parses a name produced by DataTypeName (and "bool_" / "half" / "float" / "double" aliases).
// INVALID_ARGUMENT naming `field` if the name is unknown.
absl::StatusOr<DLDataType> ParseDataType(absl::string_view name, absl::string_view field = "dtype");

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_TENSOR_DTYPE_H_
