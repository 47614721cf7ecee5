#include "server/memory/allocator.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tensorshm {
namespace {

constexpr uint64_t kPage = 4096;

TEST(BestFitAllocatorTest, AllocatesFromTheStartAndExhausts) {
  BestFitAllocator a(4 * kPage);
  EXPECT_EQ(a.Allocate(kPage), 0u);
  EXPECT_EQ(a.Allocate(2 * kPage), kPage);
  EXPECT_EQ(a.Allocate(2 * kPage), std::nullopt);  // one page left
  EXPECT_EQ(a.Allocate(kPage), 3 * kPage);
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_EQ(a.Allocate(kPage), std::nullopt);
}

TEST(BestFitAllocatorTest, TrimTailGivesUpOnlyTheFreeEnd) {
  BestFitAllocator a(8 * kPage);
  const uint64_t first = *a.Allocate(2 * kPage);  // [0,2)
  const uint64_t second = *a.Allocate(kPage);     // [2,3); free [3,8)
  a.Free(first, 2 * kPage);                       // free [0,2) and [3,8)
  EXPECT_EQ(a.free_tail(), 5 * kPage);
  EXPECT_EQ(a.TrimTail(), 5 * kPage);
  EXPECT_EQ(a.capacity(), 3 * kPage);
  EXPECT_EQ(a.free_bytes(), 2 * kPage);
  EXPECT_EQ(a.free_tail(), 0u);  // the last byte is in use
  EXPECT_EQ(a.TrimTail(), 0u);
  EXPECT_EQ(a.Allocate(3 * kPage), std::nullopt);  // nothing is placed past the end
  // A buffer freed at the new end merges into a free end that can be trimmed again.
  a.Free(second, kPage);
  EXPECT_EQ(a.free_tail(), 3 * kPage);
  EXPECT_EQ(a.TrimTail(), 3 * kPage);
  EXPECT_EQ(a.capacity(), 0u);
  EXPECT_EQ(a.free_bytes(), 0u);
}

TEST(BestFitAllocatorTest, ChoosesTheSmallestBlockThatFits) {
  BestFitAllocator a(10 * kPage);
  const uint64_t a0 = *a.Allocate(3 * kPage);  // [0,3)
  const uint64_t a1 = *a.Allocate(kPage);      // [3,4)
  const uint64_t a2 = *a.Allocate(kPage);      // [4,5)
  const uint64_t a3 = *a.Allocate(kPage);      // [5,6) ; free [6,10)
  a.Free(a0, 3 * kPage);                       // free: [0,3) and [6,10)
  a.Free(a2, kPage);                           // free: [0,3), [4,5), [6,10)
  EXPECT_EQ(a.free_block_count(), 3u);
  EXPECT_EQ(a.Allocate(kPage), 4 * kPage);      // the 1-page hole, not the larger ones
  EXPECT_EQ(a.Allocate(3 * kPage), 0u);         // the 3-page hole exactly
  EXPECT_EQ(a.Allocate(2 * kPage), 6 * kPage);  // carved from [6,10)
  (void)a1;
  (void)a3;
}

TEST(BestFitAllocatorTest, CoalescesWithBothNeighbours) {
  BestFitAllocator a(3 * kPage);
  const uint64_t x = *a.Allocate(kPage);
  const uint64_t y = *a.Allocate(kPage);
  const uint64_t z = *a.Allocate(kPage);
  a.Free(x, kPage);
  a.Free(z, kPage);
  EXPECT_EQ(a.free_block_count(), 2u);
  EXPECT_EQ(a.largest_free_block(), kPage);
  a.Free(y, kPage);  // merges left and right
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), 3 * kPage);
  EXPECT_EQ(a.Allocate(3 * kPage), 0u);
}

TEST(BestFitAllocatorTest, FragmentationLeavesNoBlockLargeEnough) {
  BestFitAllocator a(8 * kPage);
  std::vector<uint64_t> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(*a.Allocate(kPage));
  for (int i = 0; i < 8; i += 2) a.Free(blocks[i], kPage);  // every other page
  EXPECT_EQ(a.free_bytes(), 4 * kPage);
  EXPECT_EQ(a.largest_free_block(), kPage);
  EXPECT_EQ(a.Allocate(2 * kPage), std::nullopt);
  a.Free(blocks[1], kPage);  // joins pages 0..2
  EXPECT_EQ(a.Allocate(3 * kPage), 0u);
}

TEST(BestFitAllocatorTest, ReserveMarksRangesUsed) {
  BestFitAllocator a(10 * kPage);
  EXPECT_TRUE(a.Reserve(2 * kPage, 3 * kPage));
  EXPECT_FALSE(a.Reserve(4 * kPage, kPage));      // overlaps
  EXPECT_FALSE(a.Reserve(9 * kPage, 2 * kPage));  // past the end
  EXPECT_EQ(a.free_bytes(), 7 * kPage);
  EXPECT_EQ(a.Allocate(2 * kPage), 0u);
  a.Free(2 * kPage, 3 * kPage);
  EXPECT_EQ(a.free_bytes(), 8 * kPage);
}

TEST(BestFitAllocatorTest, DoubleFreeAborts) {
  BestFitAllocator a(4 * kPage);
  const uint64_t x = *a.Allocate(kPage);
  a.Free(x, kPage);
  EXPECT_DEATH(a.Free(x, kPage), "check failed");
}

TEST(BestFitAllocatorTest, RandomWorkloadConservesBytes) {
  const uint32_t seed = 20261121;
  std::mt19937 random(seed);
  BestFitAllocator a(1024 * kPage);
  std::vector<std::pair<uint64_t, uint64_t>> live;
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || random() % 2 == 0) {
      const uint64_t size = (1 + random() % 16) * kPage;
      if (std::optional<uint64_t> offset = a.Allocate(size)) live.emplace_back(*offset, size);
    } else {
      const size_t i = random() % live.size();
      a.Free(live[i].first, live[i].second);
      live.erase(live.begin() + i);
    }
    uint64_t used = 0;
    for (const auto& [o, s] : live) used += s;
    ASSERT_EQ(a.free_bytes() + used, a.capacity()) << "seed " << seed << " step " << step;
  }
  for (const auto& [o, s] : live) a.Free(o, s);
  EXPECT_EQ(a.free_block_count(), 1u) << "seed " << seed;
  EXPECT_EQ(a.largest_free_block(), a.capacity());
}

}  // namespace
}  // namespace tensorshm
