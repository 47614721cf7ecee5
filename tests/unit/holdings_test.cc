// Holdings (client/holdings.h): what a client holds by key, what it queues for the sender, the
// counts Flush waits on, and the re-registration with a restarted daemon. No daemon: the batch
// and the answers are the messages the sender would send and read.
#include "client/holdings.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "gtest/gtest.h"

namespace tensorshm {
namespace {

std::vector<uint64_t> Ids(const google::protobuf::RepeatedField<uint64_t>& ids) {
  return {ids.begin(), ids.end()};
}

TEST(HoldingsTest, KeysNameLeasesAndUnpublishedTensorsUntilGivenBack) {
  Holdings holdings;
  const uint64_t lease = holdings.AddLease(/*tensor_id=*/10, /*lease_id=*/100);
  const uint64_t buffer = holdings.AddUnpublished(/*tensor_id=*/20);
  EXPECT_NE(lease, buffer);
  EXPECT_EQ(holdings.outstanding(), 2);
  ASSERT_NE(holdings.FindLease(lease), nullptr);
  EXPECT_EQ(holdings.FindLease(lease)->tensor_id, 10u);
  EXPECT_EQ(holdings.FindLease(lease)->lease_id, 100u);
  EXPECT_EQ(holdings.UnpublishedId(buffer), 20u);
  EXPECT_EQ(holdings.FindLease(buffer), nullptr);
  EXPECT_EQ(holdings.UnpublishedId(lease), std::nullopt);

  holdings.Published(buffer);
  EXPECT_EQ(holdings.UnpublishedId(buffer), std::nullopt);
  EXPECT_EQ(holdings.outstanding(), 1);
  EXPECT_FALSE(holdings.Drained());
  holdings.QueueRelease(lease);
  EXPECT_EQ(holdings.outstanding(), 0);
  EXPECT_FALSE(holdings.Drained()) << "a queued release is still to be sent";
}

TEST(HoldingsTest, ABatchCarriesTheDaemonsIdsAndFlushWaitsUntilItIsSettled) {
  Holdings holdings;
  const uint64_t lease = holdings.AddLease(10, 100);
  const uint64_t buffer = holdings.AddUnpublished(20);
  holdings.QueueRelease(lease);
  holdings.QueueAbandon(buffer);
  holdings.QueueSettle(/*request_id=*/7);
  ASSERT_TRUE(holdings.HasQueued());
  const Holdings::Mark mark = holdings.Queued();
  EXPECT_EQ(mark.releases, 1u);
  EXPECT_EQ(mark.abandons, 1u);
  EXPECT_FALSE(holdings.SettledUpTo(mark));

  v1::ReleaseBatch batch;
  ASSERT_TRUE(holdings.TakeBatch(&batch, /*max_ids=*/4096));
  EXPECT_EQ(Ids(batch.lease_ids()), std::vector<uint64_t>{100});
  EXPECT_EQ(Ids(batch.abandoned_tensor_ids()), std::vector<uint64_t>{20});
  EXPECT_EQ(Ids(batch.settled_request_ids()), std::vector<uint64_t>{7});
  EXPECT_FALSE(holdings.HasQueued());
  EXPECT_TRUE(holdings.Drained());
  EXPECT_EQ(holdings.FindLease(lease), nullptr);
  EXPECT_FALSE(holdings.SettledUpTo(mark)) << "taken, not yet acknowledged";
  holdings.SettleTaken();
  EXPECT_TRUE(holdings.SettledUpTo(mark));

  v1::ReleaseBatch empty;
  EXPECT_FALSE(holdings.TakeBatch(&empty, 4096));
}

TEST(HoldingsTest, BatchesAreBoundedAndARefusedLeaseIsSettledWithoutBeingSent) {
  Holdings holdings;
  std::vector<uint64_t> keys;
  for (uint64_t i = 1; i <= 5; ++i) keys.push_back(holdings.AddLease(i, 100 + i));
  const uint64_t refused = holdings.AddLease(9, /*lease_id=*/0);  // a restart did not keep it
  for (uint64_t key : keys) holdings.QueueRelease(key);
  holdings.QueueRelease(refused);
  const Holdings::Mark mark = holdings.Queued();
  EXPECT_EQ(mark.releases, 6u);

  std::vector<uint64_t> sent;
  int batches = 0;
  while (holdings.HasQueued()) {
    v1::ReleaseBatch batch;
    holdings.TakeBatch(&batch, /*max_ids=*/2);
    EXPECT_LE(batch.lease_ids_size(), 2);
    for (uint64_t id : batch.lease_ids()) sent.push_back(id);
    ++batches;
    ASSERT_LT(batches, 10);
  }
  EXPECT_EQ(sent, (std::vector<uint64_t>{101, 102, 103, 104, 105}));
  holdings.SettleTaken();
  EXPECT_TRUE(holdings.SettledUpTo(mark));
}

TEST(HoldingsTest, AReconnectReregistersWhatIsHeldAndReportsWhatTheNewDaemonDidNotTakeBack) {
  Holdings holdings;
  const uint64_t kept = holdings.AddLease(10, 100);
  const uint64_t dropped = holdings.AddLease(11, 101);
  const uint64_t refused_before = holdings.AddLease(12, /*lease_id=*/0);
  const uint64_t buffer = holdings.AddUnpublished(20);

  v1::SessionOpen open;
  const Holdings::Reattach asked = holdings.ForReattach(&open);
  ASSERT_EQ(asked.lease_keys.size(), 2u) << "a lease refused before stays refused";
  ASSERT_EQ(open.held_tensor_ids_size(), 2);
  EXPECT_EQ(open.unpublished_tensor_ids_size(), 1);
  EXPECT_EQ(open.unpublished_tensor_ids(0), 20u);

  // The new daemon keeps the lease on tensor 10 (new id 700), not the one on 11, nor the buffer.
  v1::SessionOpened answer;
  for (size_t i = 0; i < asked.lease_keys.size(); ++i) {
    answer.add_lease_ids(open.held_tensor_ids(static_cast<int>(i)) == 10 ? 700 : 0);
  }
  answer.add_readopted(false);
  std::vector<uint64_t> lost = holdings.Reattached(asked, answer);
  std::sort(lost.begin(), lost.end());
  EXPECT_EQ(lost, (std::vector<uint64_t>{11, 20}));
  EXPECT_EQ(holdings.FindLease(kept)->lease_id, 700u);
  EXPECT_EQ(holdings.FindLease(dropped)->lease_id, 0u);
  EXPECT_EQ(holdings.FindLease(refused_before)->lease_id, 0u);
  EXPECT_EQ(holdings.UnpublishedId(buffer), std::nullopt);
}

TEST(HoldingsTest, WhatWasQueuedForADeadSessionIsDroppedAndCountsAsSettled) {
  Holdings holdings;
  const uint64_t lease = holdings.AddLease(10, 100);
  const uint64_t buffer = holdings.AddUnpublished(20);
  holdings.QueueRelease(lease);
  holdings.QueueAbandon(buffer);
  holdings.QueueSettle(7);
  const Holdings::Mark mark = holdings.Queued();
  holdings.DropQueued();
  EXPECT_FALSE(holdings.HasQueued());
  EXPECT_TRUE(holdings.SettledUpTo(mark));
  EXPECT_EQ(holdings.FindLease(lease), nullptr) << "never re-registered with the next daemon";
  v1::SessionOpen open;
  EXPECT_TRUE(holdings.ForReattach(&open).lease_keys.empty());
  EXPECT_TRUE(holdings.Drained());
}

}  // namespace
}  // namespace tensorshm
