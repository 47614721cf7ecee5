#include "arrow/metadata.h"

#include <cstring>
#include <exception>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/tensor/dtype.h"
#include "nlohmann/json.hpp"

namespace tensorshm::python {

absl::StatusOr<DLDataType> DataTypeOfFormat(absl::string_view format) {
  if (std::optional<DLDataType> dtype = DataTypeOfArrowFormat(format)) return *dtype;
  return absl::InvalidArgumentError(
      absl::StrCat("the tensor's value type has Arrow format \"", format,
                   "\": put() takes int8..int64, uint8..uint64 and float16/32/64 values"));
}

std::string WhyNoArrowType(const DLDataType& dtype) {
  if (dtype.lanes != 1) return "vector elements (lanes != 1) have no Arrow primitive type";
  if (dtype.code == kDLBool) {
    return "Arrow booleans are bit-packed, tensorshm's take a byte each, so no zero-copy view "
           "exists";
  }
  if (dtype.code == kDLComplex) return "Arrow has no complex type";
  if (ElementBits(dtype) < 8) return "Arrow has no sub-byte numeric type";
  return "Arrow has no primitive type with these bytes";
}

std::string EncodeMetadata(const std::vector<std::pair<std::string, std::string>>& pairs) {
  std::string out;
  auto put_int = [&out](int32_t value) {
    out.append(reinterpret_cast<const char*>(&value), sizeof(value));
  };
  put_int(static_cast<int32_t>(pairs.size()));
  for (const auto& [key, value] : pairs) {
    put_int(static_cast<int32_t>(key.size()));
    out += key;
    put_int(static_cast<int32_t>(value.size()));
    out += value;
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> DecodeMetadata(
    const char* metadata) {
  std::vector<std::pair<std::string, std::string>> pairs;
  if (metadata == nullptr) return pairs;
  auto get_int = [&metadata]() {
    int32_t value;
    std::memcpy(&value, metadata, sizeof(value));
    metadata += sizeof(value);
    return value;
  };
  const int32_t count = get_int();
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("schema metadata: count = ", count));
  }
  for (int32_t i = 0; i < count; ++i) {
    std::string parts[2];
    for (std::string& part : parts) {
      const int32_t length = get_int();
      if (length < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("schema metadata: pair ", i, " has length ", length));
      }
      part.assign(metadata, static_cast<size_t>(length));
      metadata += length;
    }
    pairs.emplace_back(std::move(parts[0]), std::move(parts[1]));
  }
  return pairs;
}

namespace {

// Reads `params[key]` into `out` when it is there: an array of integers, else INVALID_ARGUMENT.
absl::Status ReadIntegers(const nlohmann::json& params, const char* key, absl::string_view text,
                          std::vector<int64_t>* out, bool* has) {
  const auto it = params.find(key);
  if (it == params.end()) return absl::OkStatus();
  *has = true;
  const auto not_integers = [&] {
    return absl::InvalidArgumentError(absl::StrCat("ARROW:extension:metadata = '", text, "': \"",
                                                   key, "\" must be an array of integers"));
  };
  if (!it->is_array()) return not_integers();
  for (const nlohmann::json& value : *it) {
    if (value.is_number_integer()) {
      out->push_back(value.get<int64_t>());
    } else if (value.is_number_unsigned() &&
               value.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) {
      out->push_back(static_cast<int64_t>(value.get<uint64_t>()));
    } else {
      return not_integers();
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ExtensionParams> ParseExtensionParams(absl::string_view text) {
  nlohmann::json params;
  try {
    params = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("ARROW:extension:metadata = '", text, "': not JSON (", e.what(), ")"));
  }
  if (!params.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ARROW:extension:metadata = '", text, "': expected a JSON object"));
  }
  ExtensionParams out;
  if (absl::Status s = ReadIntegers(params, "shape", text, &out.shape, &out.has_shape); !s.ok()) {
    return s;
  }
  if (absl::Status s =
          ReadIntegers(params, "permutation", text, &out.permutation, &out.has_permutation);
      !s.ok()) {
    return s;
  }
  return out;
}

std::string FormatExtensionParams(const std::vector<int64_t>& shape) {
  return nlohmann::json{{"shape", shape}}.dump();
}

}  // namespace tensorshm::python
