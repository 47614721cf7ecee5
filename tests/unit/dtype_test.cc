#include "common/tensor/dtype.h"

#include <optional>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace tensorshm {
namespace {

TEST(MakeDataTypeTest, AcceptsEveryDlpackCodeWithItsWidths) {
  struct Good {
    uint32_t code, bits, lanes;
    const char* name;
  };
  for (const Good& g : std::vector<Good>{
           {kDLInt, 8, 1, "int8"},
           {kDLInt, 64, 1, "int64"},
           {kDLUInt, 16, 1, "uint16"},
           {kDLUInt, 4, 1, "uint4"},
           {kDLFloat, 16, 1, "float16"},
           {kDLFloat, 32, 4, "float32x4"},
           {kDLBfloat, 16, 1, "bfloat16"},
           {kDLComplex, 64, 1, "complex64"},
           {kDLComplex, 128, 1, "complex128"},
           {kDLBool, 8, 1, "bool"},
           {kDLFloat8_e3m4, 8, 1, "float8_e3m4"},
           {kDLFloat8_e4m3, 8, 1, "float8_e4m3"},
           {kDLFloat8_e4m3b11fnuz, 8, 1, "float8_e4m3b11fnuz"},
           {kDLFloat8_e4m3fn, 8, 1, "float8_e4m3fn"},
           {kDLFloat8_e4m3fnuz, 8, 1, "float8_e4m3fnuz"},
           {kDLFloat8_e5m2, 8, 1, "float8_e5m2"},
           {kDLFloat8_e5m2fnuz, 8, 1, "float8_e5m2fnuz"},
           {kDLFloat8_e8m0fnu, 8, 1, "float8_e8m0fnu"},
           {kDLFloat6_e2m3fn, 6, 1, "float6_e2m3fn"},
           {kDLFloat6_e3m2fn, 6, 1, "float6_e3m2fn"},
           {kDLFloat4_e2m1fn, 4, 1, "float4_e2m1fn"},
       }) {
    absl::StatusOr<DLDataType> dtype = MakeDataType(g.code, g.bits, g.lanes);
    ASSERT_TRUE(dtype.ok()) << g.name << ": " << dtype.status();
    EXPECT_EQ(DataTypeName(*dtype), g.name);
    absl::StatusOr<DLDataType> parsed = ParseDataType(g.name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->code, dtype->code);
    EXPECT_EQ(parsed->bits, dtype->bits);
    EXPECT_EQ(parsed->lanes, dtype->lanes);
  }
}

TEST(MakeDataTypeTest, RefusesWhatDlpackDoesNotAllowNamingTheValues) {
  struct Bad {
    uint32_t code, bits, lanes;
    const char* mentions;
  };
  for (const Bad& b : std::vector<Bad>{
           {18, 8, 1, "code: 18"},
           {kDLFloat, 8, 1, "float takes bits 16, 32, 64"},
           {kDLFloat, 7, 1, "bits: 7"},
           {kDLInt, 128, 1, "bits: 128"},
           {kDLBool, 1, 1, "bool takes bits 8"},
           {kDLFloat8_e5m2, 16, 1, "bits: 16"},
           {kDLFloat4_e2m1fn, 8, 1, "bits: 8"},
           {kDLOpaqueHandle, 64, 1, "opaque handles"},
           {kDLInt, 32, 0, "lanes: 0"},
           {kDLInt, 32, 65536, "lanes: 65536"},
           {kDLFloat6_e2m3fn, 6, 4, "sub-byte"},
       }) {
    absl::StatusOr<DLDataType> dtype = MakeDataType(b.code, b.bits, b.lanes);
    ASSERT_FALSE(dtype.ok()) << b.mentions;
    EXPECT_EQ(dtype.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(dtype.status().message(), b.mentions)) << dtype.status();
    EXPECT_TRUE(absl::StartsWith(dtype.status().message(), "dtype = {")) << dtype.status();
  }
}

TEST(ParseDataTypeTest, AliasesAndUnknownNames) {
  EXPECT_EQ(ParseDataType("half")->bits, 16);
  EXPECT_EQ(ParseDataType("double")->bits, 64);
  EXPECT_EQ(ParseDataType("bool_")->code, kDLBool);
  EXPECT_EQ(ParseDataType("int8x4")->lanes, 4);
  EXPECT_EQ(ParseDataType("float33").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(ParseDataType("float33").status().message(), "float33"));
}

TEST(DataTypeTest, SubByteAndElementBits) {
  EXPECT_TRUE(IsSubByte(*MakeDataType(kDLFloat4_e2m1fn, 4, 1)));
  EXPECT_TRUE(IsSubByte(*MakeDataType(kDLFloat6_e3m2fn, 6, 1)));
  EXPECT_FALSE(IsSubByte(*MakeDataType(kDLFloat, 16, 1)));
  EXPECT_EQ(ElementBits(*MakeDataType(kDLFloat, 32, 4)), 128);
}

TEST(DataTypeTest, NamesElsewhereComeFromTheOneTable) {
  const DLDataType f32{kDLFloat, 32, 1};
  EXPECT_STREQ(BufferFormat(f32), "f");
  EXPECT_STREQ(ArrowFormat(f32), "f");
  EXPECT_STREQ(TritonDatatype(f32), "FP32");
  EXPECT_STREQ(BufferFormat({kDLFloat, 64, 1}), "d");
  EXPECT_STREQ(ArrowFormat({kDLFloat, 64, 1}), "g");
  EXPECT_STREQ(ArrowFormat({kDLInt, 64, 1}), "l");
  EXPECT_STREQ(BufferFormat({kDLInt, 64, 1}), "q");
  EXPECT_STREQ(BufferFormat({kDLComplex, 128, 1}), "Zd");
  EXPECT_STREQ(BufferFormat({kDLBool, 8, 1}), "?");
  EXPECT_EQ(ArrowFormat({kDLBool, 8, 1}), nullptr) << "Arrow's booleans are bit-packed";
  EXPECT_STREQ(TritonDatatype({kDLBfloat, 16, 1}), "BF16");
  EXPECT_EQ(BufferFormat({kDLBfloat, 16, 1}), nullptr);
  EXPECT_EQ(TritonDatatype({kDLFloat8_e4m3fn, 8, 1}), nullptr);
  // Vectors have no name elsewhere.
  EXPECT_EQ(BufferFormat({kDLFloat, 32, 4}), nullptr);
  EXPECT_EQ(ArrowFormat({kDLFloat, 32, 4}), nullptr);
  EXPECT_EQ(TritonDatatype({kDLFloat, 32, 4}), nullptr);
  // Every row: its name parses back to it, and its Arrow format too.
  std::set<std::string> buffer_formats;
  for (const DataTypeNames& type : AllDataTypeNames()) {
    absl::StatusOr<DLDataType> dtype = ParseDataType(type.name);
    ASSERT_TRUE(dtype.ok()) << type.name << ": " << dtype.status();
    EXPECT_EQ(BufferFormat(*dtype), type.buffer_format) << type.name;
    if (type.buffer_format != nullptr) {
      EXPECT_TRUE(buffer_formats.insert(type.buffer_format).second) << type.buffer_format;
    }
    if (type.arrow_format != nullptr) {
      std::optional<DLDataType> back = DataTypeOfArrowFormat(type.arrow_format);
      ASSERT_TRUE(back.has_value()) << type.arrow_format;
      EXPECT_EQ(DataTypeName(*back), type.name);
    }
  }
  EXPECT_EQ(AllDataTypeNames().size(), 33u);
  EXPECT_FALSE(DataTypeOfArrowFormat("u").has_value()) << "Arrow's utf8 is no tensor type";
}

}  // namespace
}  // namespace tensorshm
