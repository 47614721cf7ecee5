// HostPool: a freed buffer is handed out again first (hot memory), and only while it is free.
#include "server/host_pool.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/control_segment.h"

namespace tensorshm {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

class HostPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string prefix = absl::StrCat("tsmhostpool", getpid());
    absl::StatusOr<ControlSegment> control =
        ControlSegment::Create(prefix, 64, 16 * kMiB, 16 * kMiB, SegmentBacking::kMemfd);
    ASSERT_TRUE(control.ok()) << control.status();
    control_.emplace(*std::move(control));
    HostPoolOptions options;
    options.shm_prefix = prefix;
    options.capacity_bytes = 16 * kMiB;
    options.segment_bytes = 16 * kMiB;
    options.backing = SegmentBacking::kMemfd;
    options.owner_uid = getuid();
    absl::StatusOr<HostPool> pool = HostPool::Create(options, &*control_);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_.emplace(*std::move(pool));
  }

  Buffer Allocate(uint64_t nbytes) {
    absl::StatusOr<Buffer> buffer = pool_->Allocate(nbytes, getuid());
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    return buffer.ok() ? *buffer : Buffer{};
  }

  std::optional<ControlSegment> control_;
  std::optional<HostPool> pool_;
};

TEST_F(HostPoolTest, TheMostRecentlyFreedBufferOfALengthComesBackFirst) {
  // a | b | c | d, then a hole the size of a buffer at the start (a freed) and b freed last:
  // best fit alone would take a (the lowest offset among equals); the hot list takes b.
  const Buffer a = Allocate(kMiB);
  const Buffer b = Allocate(kMiB);
  const Buffer c = Allocate(kMiB);
  Allocate(kMiB);
  pool_->Free(a);
  pool_->Free(b);  // merges with a's hole: still free as a range
  const Buffer again = Allocate(kMiB);
  EXPECT_EQ(again.offset, b.offset);
  // Then a (freed before b).
  EXPECT_EQ(Allocate(kMiB).offset, a.offset);
  // A hot entry whose range was handed out meanwhile (merged into a larger buffer) is skipped.
  pool_->Free(c);
  pool_->Free(again);                     // b's range, hot; merges with c
  const Buffer big = Allocate(2 * kMiB);  // best fit: b and c together
  EXPECT_EQ(big.offset, b.offset);
  const Buffer next = Allocate(kMiB);
  EXPECT_NE(next.offset, b.offset);
  EXPECT_NE(next.offset, c.offset);
  EXPECT_EQ(pool_->used_bytes(), 5 * kMiB);
}

}  // namespace
}  // namespace tensorshm
