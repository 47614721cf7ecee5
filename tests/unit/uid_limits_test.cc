// UidLimits (server/ops/uid_limits.h): the per-uid counts, their limits and messages, and that
// every charge gives back what it took.
#include "server/ops/uid_limits.h"

#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace tensorshm {
namespace {

UidLimitsConfig Small() {
  UidLimitsConfig config;
  config.sessions = 2;
  config.leases = 3;
  config.waiters = 2;
  config.unpublished_bytes = 1000;
  return config;
}

TEST(UidLimitsTest, SessionsAreCountedPerUidAndRefusedPastTheLimit) {
  UidLimits limits(Small());
  {
    absl::StatusOr<UidLimits::SessionCharge> a = limits.OpenSession(65534);
    absl::StatusOr<UidLimits::SessionCharge> b = limits.OpenSession(65534);
    ASSERT_TRUE(a.ok() && b.ok());
    absl::StatusOr<UidLimits::SessionCharge> c = limits.OpenSession(65534);
    ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(c.status().message(),
              "uid 65534: 2 sessions open, limit 2 (--uid-sessions); end some of this uid's "
              "clients first");
    // Another uid has room of its own.
    absl::StatusOr<UidLimits::SessionCharge> other = limits.OpenSession(1000);
    ASSERT_TRUE(other.ok());
    EXPECT_EQ(limits.Usage(65534).sessions, 2u);
    EXPECT_EQ(limits.Usage(1000).sessions, 1u);
    EXPECT_EQ(limits.uid_count(), 2u);
  }
  // Every charge is gone: nothing is counted, and the room is back.
  EXPECT_EQ(limits.uid_count(), 0u);
  EXPECT_TRUE(limits.Usage(65534).empty());
  EXPECT_TRUE(limits.OpenSession(65534).ok());
  EXPECT_EQ(limits.uid_count(), 0u);
}

TEST(UidLimitsTest, LeasesAndBytesAreSummedOverTheSessionsOfAUid) {
  UidLimits limits(Small());
  UidLimits::SessionCharge a = *limits.OpenSession(7);
  UidLimits::SessionCharge b = *limits.OpenSession(7);
  ASSERT_TRUE(a.AddLeases(2).ok());
  ASSERT_TRUE(b.AddLeases().ok());
  absl::Status refused = b.AddLeases();
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.message(),
            "uid 7: 3 leases held, limit 3 (--uid-leases); release some acquired tensors first");
  EXPECT_TRUE(absl::StrContains(a.AddLeases(5).message(), "3 leases held, 5 more asked"));
  EXPECT_EQ(b.leases(), 1u);  // a refusal counts nothing
  a.DropLeases();
  EXPECT_TRUE(b.AddLeases().ok());

  ASSERT_TRUE(a.AddUnpublished(600).ok());
  absl::Status over = b.AddUnpublished(401);
  ASSERT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(over.message(),
            "uid 7: 600 bytes of unpublished tensors held, 401 more requested, limit 1000 bytes "
            "(--uid-quota); publish or drop some first");
  EXPECT_TRUE(b.AddUnpublished(400).ok());
  EXPECT_EQ(limits.Usage(7).unpublished_bytes, 1000u);
  // A request too large to add without wrapping is refused too.
  EXPECT_EQ(b.AddUnpublished(UINT64_MAX).code(), absl::StatusCode::kResourceExhausted);
  a.DropUnpublished(600);
  EXPECT_EQ(limits.Usage(7).unpublished_bytes, 400u);

  // Closing a session gives back its leases and bytes with it.
  b = UidLimits::SessionCharge();
  const UidUsage usage = limits.Usage(7);
  EXPECT_EQ(usage.sessions, 1u);
  EXPECT_EQ(usage.leases, 1u);
  EXPECT_EQ(usage.unpublished_bytes, 0u);
  a = UidLimits::SessionCharge();
  EXPECT_EQ(limits.uid_count(), 0u);
}

TEST(UidLimitsTest, WaitersAreCountedWhileTheirChargesLive) {
  UidLimits limits(Small());
  std::optional<UidLimits::WaitCharge> first(*limits.StartWait(42));
  UidLimits::WaitCharge second = *limits.StartWait(42);
  absl::StatusOr<UidLimits::WaitCharge> third = limits.StartWait(42);
  ASSERT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(third.status().message(),
            "uid 42: 2 acquires waiting, limit 2 (--uid-waiters); wait for fewer names at once, "
            "or acquire without waiting");
  EXPECT_TRUE(limits.StartWait(43).ok());  // another uid
  first.reset();
  absl::StatusOr<UidLimits::WaitCharge> again = limits.StartWait(42);
  EXPECT_TRUE(again.ok());
  // A moved charge is given back once, by its new owner.
  UidLimits::WaitCharge moved = std::move(second);
  EXPECT_EQ(limits.Usage(42).waiters, 2u);
  moved = UidLimits::WaitCharge();
  *again = UidLimits::WaitCharge();
  EXPECT_EQ(limits.uid_count(), 0u);
}

TEST(UidLimitsTest, ZeroMeansNoLimitAndDefaultChargesAllowEverything) {
  UidLimits limits(UidLimitsConfig{});
  std::vector<UidLimits::SessionCharge> sessions;
  std::vector<UidLimits::WaitCharge> waits;
  for (int i = 0; i < 100; ++i) {
    sessions.push_back(*limits.OpenSession(0));
    ASSERT_TRUE(sessions.back().AddLeases(1000).ok());
    ASSERT_TRUE(sessions.back().AddUnpublished(uint64_t{1} << 40).ok());
    waits.push_back(*limits.StartWait(0));
  }
  EXPECT_TRUE(limits.CheckHeldList(1u << 30).ok());
  EXPECT_EQ(limits.Usage(0).leases, 100000u);
  sessions.clear();
  waits.clear();
  EXPECT_EQ(limits.uid_count(), 0u);

  UidLimits::SessionCharge detached;  // belongs to no UidLimits
  EXPECT_TRUE(detached.AddLeases(5).ok());
  detached.DropLeases(5);
  EXPECT_TRUE(detached.AddUnpublished(5).ok());
}

TEST(UidLimitsTest, HeldListLongerThanTheLeaseLimitIsRefused) {
  UidLimits limits(Small());
  EXPECT_TRUE(limits.CheckHeldList(3).ok());
  absl::Status refused = limits.CheckHeldList(4);
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StartsWith(refused.message(), "open.held_tensor_ids: 4 entries")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "limit 3, --uid-leases")) << refused;
}

}  // namespace
}  // namespace tensorshm
