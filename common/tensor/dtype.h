// DLPack data types: which (code, bits, lanes) combinations tensorshm accepts, their names, and
// their sizes. The one table of dtype knowledge for the daemon, the clients and the bindings.
#ifndef TENSORSHM_COMMON_TENSOR_DTYPE_H_
#define TENSORSHM_COMMON_TENSOR_DTYPE_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

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

// The names a scalar dtype (lanes 1) has elsewhere, from the table in dtype.cc; nullptr where
// that side has none (vectors have none anywhere).
// PEP 3118 buffer format, native byte order: "f" for float32, "Zd" for complex128, "?" for bool.
const char* BufferFormat(const DLDataType& dtype);
// Arrow C data interface format: "f" for float32, "l" for int64 (no bool: Arrow's is bit-packed).
const char* ArrowFormat(const DLDataType& dtype);
// The dtype of an Arrow format ArrowFormat gives; nullopt for any other format.
std::optional<DLDataType> DataTypeOfArrowFormat(absl::string_view format);
// Triton's (KServe v2) datatype: "FP32", "BF16", "BOOL".
const char* TritonDatatype(const DLDataType& dtype);

// One row of the table: a dtype's name and its names elsewhere (nullptr: none there).
struct DataTypeNames {
  const char* name;
  const char* buffer_format;
  const char* arrow_format;
  const char* triton_datatype;
};
// Every scalar dtype tensorshm stores, in the table's order (for bindings that publish it).
std::vector<DataTypeNames> AllDataTypeNames();

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_TENSOR_DTYPE_H_
