// HostPool: a freed buffer is handed out again first (hot memory), and only while it is free.
#include "server/memory/host_pool.h"

#include <unistd.h>

#include <map>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/memory/control_segment.h"

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

// A pool of 16 MiB in segments of at most 4 MiB, shared by the owner uid and uid 1000.
class SharedHostPoolTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kOther = 1000;
  void SetUp() override {
    const std::string prefix = absl::StrCat("tsmsharedpool", getpid());
    absl::StatusOr<ControlSegment> control =
        ControlSegment::Create(prefix, 64, 16 * kMiB, 16 * kMiB, SegmentBacking::kMemfd);
    ASSERT_TRUE(control.ok()) << control.status();
    control_.emplace(*std::move(control));
    HostPoolOptions options;
    options.shm_prefix = prefix;
    options.capacity_bytes = 16 * kMiB;
    options.segment_bytes = 4 * kMiB;
    options.backing = SegmentBacking::kMemfd;
    options.owner_uid = getuid();
    options.instance = 0x1234;
    absl::StatusOr<HostPool> pool = HostPool::Create(options, &*control_);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_.emplace(*std::move(pool));
  }

  // Allocates 1 MiB buffers for `uid` until refused; returns them and the refusal.
  std::vector<Buffer> Fill(uint32_t uid, absl::Status* refusal) {
    std::vector<Buffer> buffers;
    while (true) {
      absl::StatusOr<Buffer> buffer = pool_->Allocate(kMiB, uid);
      if (!buffer.ok()) {
        *refusal = buffer.status();
        return buffers;
      }
      buffers.push_back(*buffer);
    }
  }

  std::optional<ControlSegment> control_;
  std::optional<HostPool> pool_;
};

// Five buffers of 3 MiB fill 15 of the 16 MiB: each 4 MiB segment keeps one and a free end of
// 1 MiB too small for the next, so the last comes from the ends given back (their pages punched
// out, their records saying so).
TEST_F(SharedHostPoolTest, TheFreeEndsOfSegmentsGoBackSoThePoolHoldsItsSize) {
  const uint32_t uid = getuid();
  std::vector<Buffer> buffers;
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<Buffer> buffer = pool_->Allocate(3 * kMiB, uid);
    ASSERT_TRUE(buffer.ok()) << "buffer " << i << ": " << buffer.status();
    buffers.push_back(*buffer);
  }
  EXPECT_EQ(pool_->used_bytes(), 15 * kMiB);
  EXPECT_LE(pool_->reserved_bytes(), 16 * kMiB);
  EXPECT_EQ(pool_->largest_free_bytes(), kMiB);
  uint64_t held = 0;
  int trimmed = 0;
  for (uint32_t index = 0; index < pool_->segment_count(); ++index) {
    const SegmentRecord& record = control_->segment(index);
    EXPECT_EQ(record.held % HostPool::PageSize(), 0u);
    EXPECT_LE(record.held, record.size);
    trimmed += record.held < record.size ? 1 : 0;
    held += record.held;
  }
  EXPECT_GE(trimmed, 3);
  EXPECT_EQ(held, pool_->reserved_bytes());
  // A trimmed end is never handed out: the pool is full but for the 1 MiB no segment holds.
  absl::StatusOr<Buffer> more = pool_->Allocate(2 * kMiB, uid);
  EXPECT_TRUE(absl::IsResourceExhausted(more.status())) << more.status();
  for (const Buffer& buffer : buffers) {
    EXPECT_LE(buffer.offset + buffer.length, pool_->SegmentSize(buffer.segment_id));
  }
}

TEST_F(SharedHostPoolTest, AUidNeverGrowsPastItsFairShareWhileAnotherHoldsBuffers) {
  const uint32_t owner = getuid();
  ASSERT_TRUE(pool_->Allocate(kMiB, kOther).ok());
  EXPECT_EQ(pool_->FairShare(owner), 8 * kMiB);
  absl::Status refusal;
  const std::vector<Buffer> owners = Fill(owner, &refusal);
  EXPECT_EQ(owners.size(), 8u);
  EXPECT_TRUE(absl::IsResourceExhausted(refusal)) << refusal;
  EXPECT_TRUE(absl::StrContains(refusal.message(), "fair share of 8388608")) << refusal;
  EXPECT_EQ(pool_->ReservedBy(owner), 8 * kMiB);
  // The other uid still has its half.
  const std::vector<Buffer> others = Fill(kOther, &refusal);
  EXPECT_EQ(others.size(), 7u);
  EXPECT_EQ(pool_->reserved_bytes(), 16 * kMiB);
  // A uid creating (an open session that created) shares the pool before it holds anything.
  pool_->set_creating_uids([] { return std::set<uint32_t>{kOther, 2000}; });
  EXPECT_EQ(pool_->FairShare(3000), 16 * kMiB / 4);
}

TEST_F(SharedHostPoolTest, EmptySegmentsGoBackAndTheirIdsComeBackUnderANewInstance) {
  const uint32_t owner = getuid();
  absl::Status refusal;
  // Alone, the owner takes the whole pool.
  const std::vector<Buffer> owners = Fill(owner, &refusal);
  ASSERT_EQ(owners.size(), 16u);
  std::map<uint64_t, uint64_t> old_instances;  // by id
  for (uint64_t id = 1; id <= pool_->segment_count(); ++id) {
    old_instances[id] = pool_->SegmentInstance(id);
  }
  // Nothing empty: the other uid gets no room, and nothing is given back.
  EXPECT_TRUE(absl::IsResourceExhausted(pool_->Allocate(kMiB, kOther).status()));
  EXPECT_EQ(pool_->segments_given_back(), 0);
  for (const Buffer& b : owners) pool_->Free(b);
  // The other uid alone now (the owner holds nothing): it takes the whole pool back.
  const std::vector<Buffer> others = Fill(kOther, &refusal);
  EXPECT_EQ(others.size(), 16u);
  EXPECT_GT(pool_->segments_given_back(), 0);
  EXPECT_EQ(pool_->ReservedBy(owner), 0u);
  for (const Buffer& b : others) {
    ASSERT_TRUE(pool_->HasSegment(b.segment_id));
    EXPECT_EQ(pool_->SegmentOwner(b.segment_id), kOther);
    auto old = old_instances.find(b.segment_id);
    if (old != old_instances.end()) {
      EXPECT_NE(pool_->SegmentInstance(b.segment_id), old->second);
    }
  }
  // Every record says what the pool holds: live ids as memfds of the other uid, holes as holes.
  for (uint64_t id = 1; id <= pool_->segment_count(); ++id) {
    const SegmentRecord& record = control_->segment(static_cast<uint32_t>(id - 1));
    EXPECT_EQ(record.state.load(), static_cast<uint32_t>(SegmentState::kEphemeral));
    if (pool_->HasSegment(id)) {
      EXPECT_EQ(record.instance, pool_->SegmentInstance(id));
      EXPECT_EQ(record.size, pool_->SegmentSize(id));
    } else {
      EXPECT_EQ(record.size, 0u);
    }
  }
  EXPECT_EQ(pool_->RepairSegmentRecords(), 0);
}

}  // namespace
}  // namespace tensorshm
