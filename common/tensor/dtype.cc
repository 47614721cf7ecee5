#include "common/tensor/dtype.h"

#include <array>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace tensorshm {
namespace {

// Every scalar type tensorshm stores, by DLPack code and bit width, with its numpy or
// ml_dtypes name. A code/bits pair absent from this table is refused.
struct ScalarType {
  uint8_t code;
  uint8_t bits;
  const char* name;
};

constexpr std::array<ScalarType, 33> kScalarTypes = {{
    {kDLInt, 4, "int4"},
    {kDLInt, 8, "int8"},
    {kDLInt, 16, "int16"},
    {kDLInt, 32, "int32"},
    {kDLInt, 64, "int64"},
    {kDLUInt, 4, "uint4"},
    {kDLUInt, 8, "uint8"},
    {kDLUInt, 16, "uint16"},
    {kDLUInt, 32, "uint32"},
    {kDLUInt, 64, "uint64"},
    {kDLFloat, 16, "float16"},
    {kDLFloat, 32, "float32"},
    {kDLFloat, 64, "float64"},
    {kDLBfloat, 16, "bfloat16"},
    {kDLComplex, 32, "complex32"},
    {kDLComplex, 64, "complex64"},
    {kDLComplex, 128, "complex128"},
    {kDLBool, 8, "bool"},
    {kDLFloat8_e3m4, 8, "float8_e3m4"},
    {kDLFloat8_e4m3, 8, "float8_e4m3"},
    {kDLFloat8_e4m3b11fnuz, 8, "float8_e4m3b11fnuz"},
    {kDLFloat8_e4m3fn, 8, "float8_e4m3fn"},
    {kDLFloat8_e4m3fnuz, 8, "float8_e4m3fnuz"},
    {kDLFloat8_e5m2, 8, "float8_e5m2"},
    {kDLFloat8_e5m2fnuz, 8, "float8_e5m2fnuz"},
    {kDLFloat8_e8m0fnu, 8, "float8_e8m0fnu"},
    {kDLFloat6_e2m3fn, 6, "float6_e2m3fn"},
    {kDLFloat6_e3m2fn, 6, "float6_e3m2fn"},
    {kDLFloat4_e2m1fn, 4, "float4_e2m1fn"},
    {kDLInt, 1, "int1"},
    {kDLUInt, 1, "uint1"},
    {kDLInt, 2, "int2"},
    {kDLUInt, 2, "uint2"},
}};

constexpr uint32_t kMaxCode = kDLFloat4_e2m1fn;

const char* CodeName(uint32_t code) {
  switch (code) {
    case kDLInt:
      return "int";
    case kDLUInt:
      return "uint";
    case kDLFloat:
      return "float";
    case kDLOpaqueHandle:
      return "opaque handle";
    case kDLBfloat:
      return "bfloat";
    case kDLComplex:
      return "complex";
    case kDLBool:
      return "bool";
    default:
      return code <= kMaxCode ? "float8/6/4" : "unknown";
  }
}

const ScalarType* FindScalar(uint32_t code, uint32_t bits) {
  for (const ScalarType& t : kScalarTypes) {
    if (t.code == code && t.bits == bits) return &t;
  }
  return nullptr;
}

std::string Describe(uint32_t code, uint32_t bits, uint32_t lanes) {
  return absl::StrFormat("{code: %d (%s), bits: %d, lanes: %d}", code, CodeName(code), bits, lanes);
}

}  // namespace

absl::StatusOr<DLDataType> MakeDataType(uint32_t code, uint32_t bits, uint32_t lanes,
                                        absl::string_view field) {
  // Built only for a refusal: the fast path checks every record it reads with this function.
  auto what = [&] { return absl::StrCat(field, " = ", Describe(code, bits, lanes)); };
  if (code > kMaxCode) {
    return absl::InvalidArgumentError(
        absl::StrCat(what(), ": code must be a DLPack 1.3 type code (0..", kMaxCode, ")"));
  }
  if (code == kDLOpaqueHandle) {
    return absl::InvalidArgumentError(absl::StrCat(
        what(), ": opaque handles are pointers and cannot be shared across processes"));
  }
  if (FindScalar(code, bits) == nullptr) {
    std::vector<int> allowed;
    for (const ScalarType& t : kScalarTypes) {
      if (t.code == code) allowed.push_back(t.bits);
    }
    return absl::InvalidArgumentError(
        absl::StrCat(what(), ": ", CodeName(code), " takes bits ", absl::StrJoin(allowed, ", ")));
  }
  if (lanes < 1 || lanes > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(what(), ": lanes must be in 1..65535"));
  }
  if (lanes != 1 && bits % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what(), ": vectors (lanes > 1) of sub-byte types are not supported"));
  }
  DLDataType dtype;
  dtype.code = static_cast<uint8_t>(code);
  dtype.bits = static_cast<uint8_t>(bits);
  dtype.lanes = static_cast<uint16_t>(lanes);
  return dtype;
}

std::string DataTypeName(const DLDataType& dtype) {
  const ScalarType* t = FindScalar(dtype.code, dtype.bits);
  if (t == nullptr) {
    return absl::StrFormat("dtype(code=%d,bits=%d,lanes=%d)", dtype.code, dtype.bits, dtype.lanes);
  }
  if (dtype.lanes == 1) return t->name;
  return absl::StrCat(t->name, "x", dtype.lanes);
}

absl::StatusOr<DLDataType> ParseDataType(absl::string_view name, absl::string_view field) {
  auto scalar_type = [](absl::string_view scalar) -> const ScalarType* {
    if (scalar == "bool_") scalar = "bool";
    if (scalar == "half") scalar = "float16";
    if (scalar == "float") scalar = "float32";
    if (scalar == "double") scalar = "float64";
    for (const ScalarType& t : kScalarTypes) {
      if (scalar == t.name) return &t;
    }
    return nullptr;
  };
  if (const ScalarType* t = scalar_type(name)) return MakeDataType(t->code, t->bits, 1, field);
  // A vector: "<scalar>x<lanes>".
  uint32_t lanes = 0;
  if (size_t x = name.rfind('x');
      x != absl::string_view::npos && absl::SimpleAtoi(name.substr(x + 1), &lanes)) {
    if (const ScalarType* t = scalar_type(name.substr(0, x))) {
      return MakeDataType(t->code, t->bits, lanes, field);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " = \"", absl::CHexEscape(name), "\": unknown dtype name"));
}

}  // namespace tensorshm
