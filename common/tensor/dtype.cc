#include "common/tensor/dtype.h"

#include <array>
#include <optional>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace tensorshm {
namespace {

// Every scalar type tensorshm stores, by DLPack code and bit width: its numpy or ml_dtypes name,
// its PEP 3118 buffer format (Python's buffer protocol; native byte order), its Arrow C data
// interface format, and its Triton (KServe v2) datatype; nullptr where that side has none. A
// code/bits pair absent from this table is refused. The one dtype table: the daemon, the clients,
// the buffer protocol, Arrow and tensorshm.triton all read it.
struct ScalarType {
  uint8_t code;
  uint8_t bits;
  const char* name;
  const char* buffer_format;
  const char* arrow_format;
  const char* triton_datatype;
};

constexpr std::array<ScalarType, 33> kScalarTypes = {{
    {kDLInt, 4, "int4", nullptr, nullptr, nullptr},
    {kDLInt, 8, "int8", "b", "c", "INT8"},
    {kDLInt, 16, "int16", "h", "s", "INT16"},
    {kDLInt, 32, "int32", "i", "i", "INT32"},
    {kDLInt, 64, "int64", "q", "l", "INT64"},
    {kDLUInt, 4, "uint4", nullptr, nullptr, nullptr},
    {kDLUInt, 8, "uint8", "B", "C", "UINT8"},
    {kDLUInt, 16, "uint16", "H", "S", "UINT16"},
    {kDLUInt, 32, "uint32", "I", "I", "UINT32"},
    {kDLUInt, 64, "uint64", "Q", "L", "UINT64"},
    {kDLFloat, 16, "float16", "e", "e", "FP16"},
    {kDLFloat, 32, "float32", "f", "f", "FP32"},
    {kDLFloat, 64, "float64", "d", "g", "FP64"},
    {kDLBfloat, 16, "bfloat16", nullptr, nullptr, "BF16"},
    {kDLComplex, 32, "complex32", nullptr, nullptr, nullptr},
    {kDLComplex, 64, "complex64", "Zf", nullptr, nullptr},
    {kDLComplex, 128, "complex128", "Zd", nullptr, nullptr},
    {kDLBool, 8, "bool", "?", nullptr, "BOOL"},
    {kDLFloat8_e3m4, 8, "float8_e3m4", nullptr, nullptr, nullptr},
    {kDLFloat8_e4m3, 8, "float8_e4m3", nullptr, nullptr, nullptr},
    {kDLFloat8_e4m3b11fnuz, 8, "float8_e4m3b11fnuz", nullptr, nullptr, nullptr},
    {kDLFloat8_e4m3fn, 8, "float8_e4m3fn", nullptr, nullptr, nullptr},
    {kDLFloat8_e4m3fnuz, 8, "float8_e4m3fnuz", nullptr, nullptr, nullptr},
    {kDLFloat8_e5m2, 8, "float8_e5m2", nullptr, nullptr, nullptr},
    {kDLFloat8_e5m2fnuz, 8, "float8_e5m2fnuz", nullptr, nullptr, nullptr},
    {kDLFloat8_e8m0fnu, 8, "float8_e8m0fnu", nullptr, nullptr, nullptr},
    {kDLFloat6_e2m3fn, 6, "float6_e2m3fn", nullptr, nullptr, nullptr},
    {kDLFloat6_e3m2fn, 6, "float6_e3m2fn", nullptr, nullptr, nullptr},
    {kDLFloat4_e2m1fn, 4, "float4_e2m1fn", nullptr, nullptr, nullptr},
    {kDLInt, 1, "int1", nullptr, nullptr, nullptr},
    {kDLUInt, 1, "uint1", nullptr, nullptr, nullptr},
    {kDLInt, 2, "int2", nullptr, nullptr, nullptr},
    {kDLUInt, 2, "uint2", nullptr, nullptr, nullptr},
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

const char* BufferFormat(const DLDataType& dtype) {
  const ScalarType* t = FindScalar(dtype.code, dtype.bits);
  return t != nullptr && dtype.lanes == 1 ? t->buffer_format : nullptr;
}

const char* ArrowFormat(const DLDataType& dtype) {
  const ScalarType* t = FindScalar(dtype.code, dtype.bits);
  return t != nullptr && dtype.lanes == 1 ? t->arrow_format : nullptr;
}

std::optional<DLDataType> DataTypeOfArrowFormat(absl::string_view format) {
  for (const ScalarType& t : kScalarTypes) {
    if (t.arrow_format != nullptr && format == t.arrow_format) return DLDataType{t.code, t.bits, 1};
  }
  return std::nullopt;
}

const char* TritonDatatype(const DLDataType& dtype) {
  const ScalarType* t = FindScalar(dtype.code, dtype.bits);
  return t != nullptr && dtype.lanes == 1 ? t->triton_datatype : nullptr;
}

std::vector<DataTypeNames> AllDataTypeNames() {
  std::vector<DataTypeNames> all;
  for (const ScalarType& t : kScalarTypes) {
    all.push_back({t.name, t.buffer_format, t.arrow_format, t.triton_datatype});
  }
  return all;
}

}  // namespace tensorshm
