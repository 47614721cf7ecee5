// The connection accounting behind admission at accept (server/rpc/connection_table.h) and its
// flag,
// --uid-connections: limits, stale entries of connections closed elsewhere, reused descriptor
// numbers, the daemon-wide limit and the owner's reserve, and the rate-limited refusal log.
#include "server/rpc/connection_table.h"

#include <sys/socket.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "server/ops/options.h"

namespace tensorshm {
namespace {

// One end of a fresh socket pair (the other end closed).
int Socket() {
  int pair[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  close(pair[1]);
  return pair[0];
}

constexpr uid_t kOwner = 0;
constexpr uid_t kOther = 65534;

TEST(ConnectionTableTest, DaemonLimitLeavesDescriptorsForSessionsAndSegments) {
  uint64_t reserve = 0;
  EXPECT_EQ(DaemonConnectionLimit(20000, &reserve), 12500u);
  EXPECT_EQ(reserve, 256u);
  EXPECT_EQ(DaemonConnectionLimit(600, &reserve), 356u);
  EXPECT_EQ(reserve, 44u);
  EXPECT_EQ(DaemonConnectionLimit(1024, &reserve), 640u);
  EXPECT_EQ(DaemonConnectionLimit(64, &reserve), 0u);
  EXPECT_EQ(reserve, 0u);
}

TEST(ConnectionTableTest, AUidPastItsLimitIsRefusedUntilOneOfItsConnectionsCloses) {
  ConnectionTable table({kOwner, /*per_uid=*/2, /*total=*/0, /*owner_reserve=*/0});
  absl::Time now = absl::Now();
  std::vector<int> fds;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(table.Check(kOther, true, now), ConnectionRefusal::kNone);
    fds.push_back(Socket());
    ASSERT_TRUE(table.Add(fds.back(), kOther, true).ok());
  }
  EXPECT_EQ(table.Check(kOther, true, now), ConnectionRefusal::kUidLimit);
  // The owner is not held to --uid-connections.
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(table.Check(kOwner, true, now), ConnectionRefusal::kNone);
    fds.push_back(Socket());
    ASSERT_TRUE(table.Add(fds.back(), kOwner, true).ok());
  }
  // Closed elsewhere (by gRPC, say): noticed at the next look, at most one per interval.
  close(fds[0]);
  EXPECT_EQ(table.Check(kOther, true, now),
            ConnectionRefusal::kUidLimit);  // looked at `now` already
  now += ConnectionTable::kSweepInterval;
  EXPECT_EQ(table.Check(kOther, true, now), ConnectionRefusal::kNone);
  EXPECT_EQ(table.count(kOther), 1u);
  EXPECT_EQ(table.total(), 6u);
  for (size_t i = 1; i < fds.size(); ++i) close(fds[i]);
  table.Sweep(now);
  EXPECT_EQ(table.total(), 0u);
}

TEST(ConnectionTableTest, AReusedDescriptorNumberIsANewConnection) {
  ConnectionTable table({kOwner, 1, 0, 0});
  const int fd = Socket();
  ASSERT_TRUE(table.Add(fd, kOther, true).ok());
  close(fd);
  const int again = Socket();  // the lowest free number: `fd` again
  ASSERT_EQ(again, fd);
  ASSERT_TRUE(table.Add(again, kOwner, true).ok());
  EXPECT_EQ(table.count(kOther), 0u);
  EXPECT_EQ(table.count(kOwner), 1u);
  // Another file on the number is no connection: a sweep drops it.
  close(again);
  const int file = dup(STDERR_FILENO);
  ASSERT_EQ(file, fd);
  table.Sweep(absl::Now());
  EXPECT_EQ(table.total(), 0u);
  close(file);
}

// What the listener does with a number accept() returns: the connection recorded under it has
// closed, and must not count against its uid, even where the uid was looked at a moment ago.
TEST(ConnectionTableTest, ANumberAcceptReturnsIsNotCountedBeforeTheCheck) {
  ConnectionTable table({kOwner, /*per_uid=*/2, 0, 0});
  const absl::Time now = absl::Now();
  std::vector<int> fds = {Socket(), Socket()};
  for (int fd : fds) ASSERT_TRUE(table.Add(fd, kOther, true).ok());
  ASSERT_EQ(table.Check(kOther, true, now), ConnectionRefusal::kUidLimit);  // a look at `now`
  close(fds[0]);
  const int accepted = Socket();  // the lowest free number: fds[0] again
  ASSERT_EQ(accepted, fds[0]);
  // Within the interval the uid's entries are not looked at again: the stale one still counts.
  EXPECT_EQ(table.Check(kOther, true, now), ConnectionRefusal::kUidLimit);
  table.Remove(accepted);
  EXPECT_EQ(table.count(kOther), 1u);
  EXPECT_EQ(table.Check(kOther, true, now), ConnectionRefusal::kNone);
  ASSERT_TRUE(table.Add(accepted, kOther, true).ok());
  EXPECT_EQ(table.count(kOther), 2u);
  close(accepted);
  close(fds[1]);
}

TEST(ConnectionTableTest, TheLastOfTheDaemonLimitIsTheOwnersAlone) {
  ConnectionTable table({kOwner, 0, /*total=*/4, /*owner_reserve=*/2});
  const absl::Time now = absl::Now();
  std::vector<int> fds;
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(table.Check(kOther, true, now), ConnectionRefusal::kNone);
    fds.push_back(Socket());
    ASSERT_TRUE(table.Add(fds.back(), kOther, true).ok());
  }
  EXPECT_EQ(table.Check(kOther, true, now), ConnectionRefusal::kDaemonLimit);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(table.Check(kOwner, true, now), ConnectionRefusal::kNone);
    fds.push_back(Socket());
    ASSERT_TRUE(table.Add(fds.back(), kOwner, true).ok());
  }
  EXPECT_EQ(table.Check(kOwner, true, now), ConnectionRefusal::kDaemonLimit);
  table.Remove(fds.back());
  close(fds.back());
  fds.pop_back();
  EXPECT_EQ(table.Check(kOwner, true, now), ConnectionRefusal::kNone);
  for (int fd : fds) close(fd);
}

TEST(ConnectionTableTest, AUidThatIsNotAdmittedHoldsAFewConnectionsOnly) {
  constexpr uid_t kStranger = 12345, kOtherStranger = 12346;
  ConnectionLimits limits{kOwner, 0, 0, 0};
  limits.stranger_per_uid = 2;
  limits.strangers = 3;
  ConnectionTable table(limits);
  const absl::Time now = absl::Now();
  std::vector<int> fds;
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(table.Check(kStranger, false, now), ConnectionRefusal::kNone);
    fds.push_back(Socket());
    ASSERT_TRUE(table.Add(fds.back(), kStranger, false).ok());
  }
  EXPECT_EQ(table.Check(kStranger, false, now), ConnectionRefusal::kNotAdmitted);
  ASSERT_EQ(table.Check(kOtherStranger, false, now), ConnectionRefusal::kNone);
  fds.push_back(Socket());
  ASSERT_TRUE(table.Add(fds.back(), kOtherStranger, false).ok());
  // Three in all: the next stranger is refused, an admitted uid is not.
  EXPECT_EQ(table.Check(kOtherStranger, false, now), ConnectionRefusal::kNotAdmitted);
  EXPECT_EQ(table.Check(kOther, true, now), ConnectionRefusal::kNone);
  EXPECT_EQ(table.strangers(), 3u);
  table.Remove(fds.back());
  EXPECT_EQ(table.strangers(), 2u);
  for (int fd : fds) close(fd);
}

TEST(RefusalLogTest, OneLinePerUidPerIntervalThenACount) {
  RefusalLog log(absl::Seconds(10));
  const absl::Time start = absl::Now();
  EXPECT_EQ(log.NextFlush(), absl::InfiniteFuture());
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 1000; ++i) log.Refused(12345, "refused uid 12345", start);
  log.Refused(1000, "refused uid 1000", start);
  log.Flush(start + absl::Seconds(1));  // too early: nothing
  EXPECT_EQ(log.NextFlush(), start + absl::Seconds(10));
  log.Flush(start + absl::Seconds(10));
  log.Flush(start + absl::Seconds(20));  // uid 1000 quiet, then 12345 too: forgotten
  log.Flush(start + absl::Seconds(30));
  EXPECT_EQ(log.NextFlush(), absl::InfiniteFuture());
  log.Refused(12345, "refused uid 12345 again", start + absl::Seconds(31));
  const std::string text = ::testing::internal::GetCapturedStderr();
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    lines.emplace_back(line);
  }
  ASSERT_EQ(lines.size(), 4u) << text;
  EXPECT_TRUE(absl::StrContains(lines[0], "refused uid 12345")) << text;
  EXPECT_TRUE(absl::StrContains(lines[1], "refused uid 1000")) << text;
  EXPECT_TRUE(absl::StrContains(lines[2],
                                "999 more connections of uid 12345 refused in the "
                                "last 10s; the latest: refused uid 12345"))
      << text;
  EXPECT_TRUE(absl::StrContains(lines[3], "refused uid 12345 again")) << text;
}

absl::StatusOr<DaemonOptions> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "tensorshmd");
  return ParseOptions(static_cast<int>(args.size()), const_cast<char**>(args.data()));
}

TEST(UidConnectionsOptionTest, DefaultFollowsUidSessionsAndTheFlagSetsIt) {
  EXPECT_EQ(DefaultUidConnections(1024), 2112u);
  EXPECT_EQ(DefaultUidConnections(0), 0u);
  absl::StatusOr<DaemonOptions> options = Parse({});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->uid_connections, 2112u);
  options = Parse({"--uid-sessions", "10"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->uid_connections, 84u);
  options = Parse({"--uid-sessions", "10", "--uid-connections", "5"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->uid_connections, 5u);
  options = Parse({"--uid-connections", "0"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->uid_connections, 0u);
  EXPECT_TRUE(absl::StrContains(Usage(), "--uid-connections N"));
  options = Parse({"--uid-connections", "-3"});
  ASSERT_FALSE(options.ok());
  EXPECT_TRUE(absl::StrContains(options.status().message(), "--uid-connections = \"-3\""))
      << options.status();
}

}  // namespace
}  // namespace tensorshm
