// arrow.fixed_shape_tensor's type: Arrow format strings of tensorshm element types, the C Data
// Interface's metadata encoding, and the extension's JSON parameters (read with nlohmann-json).
#ifndef TENSORSHM_PYTHON_ARROW_METADATA_H_
#define TENSORSHM_PYTHON_ARROW_METADATA_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorshm::python {

// PyCapsule names of the Arrow PyCapsule interface.
inline constexpr char kSchemaCapsule[] = "arrow_schema";
inline constexpr char kArrayCapsule[] = "arrow_array";
inline constexpr char kDeviceArrayCapsule[] = "arrow_device_array";
// The canonical extension type, and the schema metadata keys that name it and its parameters.
inline constexpr char kExtensionName[] = "arrow.fixed_shape_tensor";
inline constexpr char kNameKey[] = "ARROW:extension:name";
inline constexpr char kMetadataKey[] = "ARROW:extension:metadata";

// An element type's Arrow format string is tensorshm::ArrowFormat (common/tensor/dtype.h).

// The tensorshm element type of an Arrow primitive format string; INVALID_ARGUMENT naming the
// format and the types put() takes otherwise.
absl::StatusOr<DLDataType> DataTypeOfFormat(absl::string_view format);

// Why `dtype` has no Arrow export, for the error message.
std::string WhyNoArrowType(const DLDataType& dtype);

// The Arrow C Data Interface's metadata encoding: int32 count, then int32-length-prefixed keys
// and values, in native byte order.
std::string EncodeMetadata(const std::vector<std::pair<std::string, std::string>>& pairs);

// The metadata's pairs; an empty list for NULL. INVALID_ARGUMENT if it overruns itself (the
// encoding carries no total length: a producer's bad count is caught by negative lengths only).
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> DecodeMetadata(
    const char* metadata);

// The parameters of arrow.fixed_shape_tensor (its ARROW:extension:metadata, a JSON object
// {"shape": [...], "dim_names": [...], "permutation": [...]}) that tensorshm reads.
struct ExtensionParams {
  std::vector<int64_t> shape;
  std::vector<int64_t> permutation;
  bool has_shape = false;
  bool has_permutation = false;
};

// Parses `text`: a JSON object whose "shape" and "permutation", when there, are arrays of
// integers; other keys are ignored. INVALID_ARGUMENT quoting the text and saying what is wrong.
absl::StatusOr<ExtensionParams> ParseExtensionParams(absl::string_view text);

// The extension metadata of an element of shape `shape` (the tensor's shape[1:]):
// {"shape":[d1,d2,...]}, compact.
std::string FormatExtensionParams(const std::vector<int64_t>& shape);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_ARROW_METADATA_H_
