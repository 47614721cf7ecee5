// How a host pool is shared between uids (issue 21; docs/daemon.md, "How a pool is shared between
// uids"), on a real daemon with real client processes run as other uids (setpriv): each uid
// creating tensors gets its fair share of the pool, whichever fills first, and the empty segments
// of one uid go back to another that needs the room. Every tensor's bytes are checked at the end.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int64_t kMiB = 1 << 20;
constexpr int64_t kTensorBytes = 16 * 1024;  // one 16 KiB tensor: four pages
constexpr int kOwner = -1;                   // the daemon's (this test's) uid

// Runs tsm_share_client `args` (after its mode and the socket) as `uid` (kOwner: as this
// process) to its end; returns its output, with "exit N" appended unless it exited 0.
std::string RunAs(const TestDaemon& daemon, int uid, const std::string& mode,
                  const std::vector<std::string>& args) {
  static int runs = 0;
  std::vector<std::string> argv;
  if (uid != kOwner) argv = AsUid(uid);
  argv.insert(argv.end(), {TSM_SHARE_CLIENT_PATH, mode, daemon.socket()});
  argv.insert(argv.end(), args.begin(), args.end());
  // A fill of 4,096 puts takes 100 s and more under ASan on a busy 2-core machine.
  return RunToEnd(argv, absl::StrCat(daemon.dir(), "/share-", mode, "-", uid, "-", ++runs, ".log"),
                  absl::Seconds(300));
}

// The number after "put " in `output`, or -1.
int64_t PutCount(const std::string& output) {
  int64_t count = -1;
  if (!absl::SimpleAtoi(Line(output, "put"), &count)) return -1;
  return count;
}

std::string Prefix(int uid) { return uid == kOwner ? "owner" : absl::StrCat("uid", uid); }

// Puts 16 KiB tensors as `uid` until refused, numbered from `first`; returns how many it put.
int64_t Fill(const TestDaemon& daemon, int uid, int64_t first) {
  const std::string output = RunAs(
      daemon, uid, "put", {Prefix(uid), std::to_string(first), "-1", std::to_string(kTensorBytes)});
  std::cout << Prefix(uid) << " fill: " << output;
  EXPECT_TRUE(absl::StrContains(output, "refused 8 host pool: cannot allocate")) << output;
  return PutCount(output);
}

int64_t UsedBytes(const TestDaemon& daemon) {
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon.socket(), "pool_share_test"});
  TSM_CHECK(client.ok());
  tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
  TSM_CHECK(stats.ok());
  return stats->pools[0].used_bytes;
}

// (These tests are about bytes: --uid-tensors 0 lifts the per-uid count of records, whose
// default share, --max-tensors / uids, would refuse a uid taking the whole pool's 4,096 tensors.)

// --host-pool 64Mi --allow-uid U: each of the two uids puts its half of the pool, whichever
// fills first; then one uid's tensors go and the other takes the whole pool (the first one's
// empty segments are given back), and the other way round.
void TwoUids(bool owner_first) {
  constexpr int kOther = 65534;
  absl::StatusOr<TestDaemon> daemon = StartAdmitting(
      owner_first ? "share2-owner" : "share2-other",
      {"--host-pool", "64Mi", "--max-tensors", "8192", "--uid-tensors", "0"}, {kOther});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  constexpr int64_t kShare = 32 * kMiB / kTensorBytes;  // 2048 tensors each
  constexpr int64_t kWhole = 64 * kMiB / kTensorBytes;  // 4096
  // Both uids create: each holds one tensor before either fills.
  for (int uid : {kOwner, kOther}) {
    const std::string output =
        RunAs(*daemon, uid, "put", {Prefix(uid), "0", "1", std::to_string(kTensorBytes)});
    ASSERT_EQ(PutCount(output), 1) << output;
  }
  const int a = owner_first ? kOwner : kOther;
  const int b = owner_first ? kOther : kOwner;
  const int64_t put_a = 1 + Fill(*daemon, a, 1);
  const int64_t put_b = 1 + Fill(*daemon, b, 1);
  EXPECT_EQ(put_a, kShare);
  EXPECT_EQ(put_b, kShare);
  EXPECT_EQ(UsedBytes(*daemon), (put_a + put_b) * kTensorBytes);
  for (int uid : {a, b}) {
    const std::string output =
        RunAs(*daemon, kOwner, "check", {Prefix(uid), std::to_string(kShare)});
    EXPECT_EQ(Line(output, "checked"), std::to_string(kShare)) << output;
  }

  // a's tensors go: b alone shares the pool now, and a's empty segments come back to it.
  std::string output = RunAs(*daemon, a, "delete", {Prefix(a), std::to_string(put_a)});
  ASSERT_EQ(Line(output, "deleted"), std::to_string(put_a)) << output;
  const int64_t more_b = Fill(*daemon, b, put_b);
  EXPECT_EQ(put_b + more_b, kWhole);
  output = RunAs(*daemon, kOwner, "check", {Prefix(b), std::to_string(put_b + more_b)});
  EXPECT_EQ(Line(output, "checked"), std::to_string(put_b + more_b)) << output;

  // And back: b's tensors go, a takes the whole pool from b's empty segments.
  output = RunAs(*daemon, b, "delete", {Prefix(b), std::to_string(put_b + more_b)});
  ASSERT_EQ(Line(output, "deleted"), std::to_string(put_b + more_b)) << output;
  const int64_t again_a = Fill(*daemon, a, 0);
  EXPECT_EQ(again_a, kWhole);
  output = RunAs(*daemon, kOwner, "check", {Prefix(a), std::to_string(again_a)});
  EXPECT_EQ(Line(output, "checked"), std::to_string(again_a)) << output;
}

TEST(PoolShareTest, TwoUidsEachGetHalfOwnerFirst) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run clients as uid 65534 (setpriv)";
  TwoUids(/*owner_first=*/true);
}

TEST(PoolShareTest, TwoUidsEachGetHalfOtherFirst) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run clients as uid 65534 (setpriv)";
  TwoUids(/*owner_first=*/false);
}

// Four uids and a pool of four segments: every uid gets its segment's worth; once all have
// freed everything, one uid takes the whole pool.
TEST(PoolShareTest, FourUidsInAPoolOfFourSegments) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run clients as other uids (setpriv)";
  const std::vector<int> others = {65534, 65533, 65532};
  absl::StatusOr<TestDaemon> daemon =
      StartAdmitting("share4",
                     {"--host-pool", "64Mi", "--segment-size", "16Mi", "--max-tensors", "8192",
                      "--uid-tensors", "0"},
                     others);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::vector<int> uids = {65534, kOwner, 65533, 65532};
  for (int uid : uids) {
    const std::string output =
        RunAs(*daemon, uid, "put", {Prefix(uid), "0", "1", std::to_string(kTensorBytes)});
    ASSERT_EQ(PutCount(output), 1) << output;
  }
  constexpr int64_t kShare = 16 * kMiB / kTensorBytes;  // 1024 tensors each
  std::vector<int64_t> put;
  for (int uid : uids) {
    put.push_back(1 + Fill(*daemon, uid, 1));
    EXPECT_EQ(put.back(), kShare) << Prefix(uid);
  }
  for (size_t i = 0; i < uids.size(); ++i) {
    std::string output = RunAs(*daemon, kOwner, "check", {Prefix(uids[i]), std::to_string(put[i])});
    EXPECT_EQ(Line(output, "checked"), std::to_string(put[i])) << output;
    output = RunAs(*daemon, uids[i], "delete", {Prefix(uids[i]), std::to_string(put[i])});
    ASSERT_EQ(Line(output, "deleted"), std::to_string(put[i])) << output;
  }
  EXPECT_EQ(UsedBytes(*daemon), 0);
  const int64_t whole = Fill(*daemon, 65533, 0);
  EXPECT_EQ(whole, 64 * kMiB / kTensorBytes);
  const std::string output =
      RunAs(*daemon, kOwner, "check", {Prefix(65533), std::to_string(whole)});
  EXPECT_EQ(Line(output, "checked"), std::to_string(whole)) << output;
}

}  // namespace
}  // namespace tensorshm::testing
