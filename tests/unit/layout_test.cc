#include "common/tensor/layout.h"

#include <limits>

#include "absl/strings/match.h"
#include "common/tensor/dtype.h"
#include "gtest/gtest.h"

namespace tensorshm {
namespace {

const DLDataType kF32{kDLFloat, 32, 1};
const DLDataType kF4{kDLFloat4_e2m1fn, 4, 1};
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

TEST(ComputeLayoutTest, ContiguousShapes) {
  absl::StatusOr<TensorLayout> layout = ComputeLayout(kF32, {2, 3, 4}, {});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->nbytes, 96);
  EXPECT_EQ(layout->byte_offset, 0u);
  EXPECT_EQ(layout->strides, (std::vector<int64_t>{12, 4, 1}));
}

TEST(ComputeLayoutTest, ZeroDimensionalHasOneElement) {
  absl::StatusOr<TensorLayout> layout = ComputeLayout(kF32, {}, {});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->nbytes, 4);
  EXPECT_TRUE(layout->strides.empty());
}

TEST(ComputeLayoutTest, EmptyTensorsTakeNoBytes) {
  absl::StatusOr<TensorLayout> layout = ComputeLayout(kF32, {3, 0, 5}, {});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->nbytes, 0);
  EXPECT_EQ(layout->strides, (std::vector<int64_t>{5, 5, 1}));
}

TEST(ComputeLayoutTest, StridedLayoutsSpanTheirExtent) {
  // Fortran order 4x3.
  EXPECT_EQ(ComputeLayout(kF32, {4, 3}, {1, 4})->nbytes, 48);
  // Every other column of an 3x8 row-major matrix: the last element is at 2*8 + 2*2.
  EXPECT_EQ(ComputeLayout(kF32, {3, 3}, {8, 2})->nbytes, (2 * 8 + 2 * 2 + 1) * 4);
  // Broadcast along dim 0.
  EXPECT_EQ(ComputeLayout(kF32, {5, 4}, {0, 1})->nbytes, 16);
}

TEST(ComputeLayoutTest, NegativeStridesStartAtAByteOffset) {
  absl::StatusOr<TensorLayout> layout = ComputeLayout(kF32, {3, 4}, {-4, 1});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->nbytes, 48);
  EXPECT_EQ(layout->byte_offset, 32u);  // row 0 is the last row of storage
}

TEST(ComputeLayoutTest, SubByteTypesArePackedAndContiguous) {
  EXPECT_EQ(ComputeLayout(kF4, {9}, {})->nbytes, 5);
  EXPECT_EQ(ComputeLayout(DLDataType{kDLFloat6_e2m3fn, 6, 1}, {3}, {})->nbytes, 3);
  EXPECT_TRUE(ComputeLayout(kF4, {2, 4}, {4, 1}).ok());  // explicit C-contiguous is fine
  absl::StatusOr<TensorLayout> strided = ComputeLayout(kF4, {2, 4}, {1, 2});
  EXPECT_EQ(strided.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(strided.status().message(), "float4_e2m1fn"));
}

TEST(ComputeLayoutTest, RefusesBadShapesNamingTheField) {
  struct Bad {
    std::vector<int64_t> shape, strides;
    const char* mentions;
  };
  for (const Bad& b : std::vector<Bad>{
           {std::vector<int64_t>(33, 1), {}, "33 dimensions, at most 32"},
           {{4, -1}, {}, "shape[1] = -1"},
           {{2, 2}, {1}, "strides = [1]: 1 values for 2 dimensions"},
           {{kMax, 2}, {}, "element count overflows"},
           {{int64_t{1} << 32, int64_t{1} << 32}, {}, "element count overflows"},
           {{int64_t{1} << 62}, {}, "byte extent overflows"},
           {{3, 2}, {kMax, 1}, "stride extent overflows"},
           {{3, 3}, {int64_t{1} << 61, -(int64_t{1} << 61)}, "overflows"},
           {{2}, {std::numeric_limits<int64_t>::min()}, "overflows"},
           // Broadcast: a 4-byte extent, but 2^64 bytes of elements (issue 22).
           {{int64_t{1} << 62}, {0}, "logical size (element count x element size) overflows"},
           {{int64_t{1} << 31, int64_t{1} << 31}, {0, 0}, "logical size"},
       }) {
    absl::StatusOr<TensorLayout> layout = ComputeLayout(kF32, b.shape, b.strides);
    ASSERT_FALSE(layout.ok()) << b.mentions;
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(layout.status().message(), b.mentions)) << layout.status();
  }
}

TEST(ComputeLayoutTest, ZeroStridesSpanOneElementPerBroadcastDimension) {
  // Legal: [2^40] float32 broadcast from one element takes 4 bytes (its consumers see 2^40).
  absl::StatusOr<TensorLayout> layout = ComputeLayout(kF32, {int64_t{1} << 40}, {0});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->nbytes, 4);
  layout = ComputeLayout(kF32, {3, int64_t{1} << 40}, {1, 0});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->nbytes, 12);
  // 2^61 - 1 float32 elements are 2^63 - 4 bytes, which fit int64; 2^61 of them do not.
  EXPECT_TRUE(ComputeLayout(kF32, {(int64_t{1} << 61) - 1}, {0}).ok());
  EXPECT_FALSE(ComputeLayout(kF32, {int64_t{1} << 61}, {0}).ok());
}

TEST(ComputeLayoutTest, OverflowIsCheckedEvenWithAZeroDimension) {
  EXPECT_FALSE(ComputeLayout(kF32, {0, kMax, kMax}, {}).ok());
  EXPECT_TRUE(ComputeLayout(kF32, {0, kMax}, {}).ok());
}

TEST(ComputeLayoutTest, ThirtyTwoDimensionsAreFine) {
  absl::StatusOr<TensorLayout> layout = ComputeLayout(kF32, std::vector<int64_t>(32, 2), {});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->nbytes, (int64_t{1} << 32) * 4);
}

}  // namespace
}  // namespace tensorshm

namespace tensorshm {
namespace {

TEST(ComputeLayoutTest, PaddedSubByteTypesTakeAByteEachAndAnyStrides) {
  const DLDataType int4{kDLInt, 4, 1};
  absl::StatusOr<TensorLayout> layout =
      ComputeLayout(int4, {3, 5}, {1, 3}, /*subbyte_padded=*/true);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->nbytes, 15);
  EXPECT_EQ(ComputeLayout(int4, {9}, {}, true)->nbytes, 9);
  absl::StatusOr<TensorLayout> not_sub_byte =
      ComputeLayout(DLDataType{kDLFloat, 32, 1}, {2}, {}, true);
  EXPECT_EQ(not_sub_byte.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(not_sub_byte.status().message(), "float32"));
}

}  // namespace
}  // namespace tensorshm
