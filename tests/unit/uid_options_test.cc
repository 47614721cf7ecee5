// The per-uid limit flags of tensorshmd (--uid-sessions, --uid-leases, --uid-waiters,
// --uid-quota): defaults, parsing and refusals.
#include <set>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/ops/options.h"

namespace tensorshm {
namespace {

absl::StatusOr<DaemonOptions> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "tensorshmd");
  return ParseOptions(static_cast<int>(args.size()), const_cast<char**>(args.data()));
}

TEST(UidLimitOptionsTest, DefaultsBoundEveryUidButTheQuota) {
  absl::StatusOr<DaemonOptions> options = Parse({});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->uid_limits.sessions, 1024u);
  EXPECT_EQ(options->uid_limits.leases, 262144u);
  EXPECT_GE(options->uid_limits.waiters, 20000u);  // the load test's waiters fit
  EXPECT_EQ(options->uid_limits.waiters, 32768u);
  EXPECT_EQ(options->uid_limits.unpublished_bytes, 0u);  // the pool bounds it
  const std::string usage = Usage();
  for (const char* flag :
       {"--uid-sessions N", "--uid-leases N", "--uid-waiters N", "--uid-quota SIZE"}) {
    EXPECT_TRUE(absl::StrContains(usage, flag)) << flag;
  }
}

TEST(UidLimitOptionsTest, FlagsSetTheLimits) {
  absl::StatusOr<DaemonOptions> options = Parse(
      {"--uid-sessions", "16", "--uid-leases=100", "--uid-waiters", "0", "--uid-quota", "64Mi"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->uid_limits.sessions, 16u);
  EXPECT_EQ(options->uid_limits.leases, 100u);
  EXPECT_EQ(options->uid_limits.waiters, 0u);  // no limit
  EXPECT_EQ(options->uid_limits.unpublished_bytes, 64u << 20);
}

TEST(UidLimitOptionsTest, BadValuesNameTheFlagAndValue) {
  for (const char* flag : {"--uid-sessions", "--uid-leases", "--uid-waiters"}) {
    for (const char* bad : {"-1", "", "x", "1.5", "+3", "99999999999999999999999"}) {
      absl::StatusOr<DaemonOptions> options = Parse({flag, bad});
      ASSERT_FALSE(options.ok()) << flag << " " << bad;
      EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_TRUE(absl::StartsWith(options.status().message(),
                                   absl::StrCat(flag, " = \"", bad, "\": expected a whole number")))
          << options.status();
    }
  }
  absl::StatusOr<DaemonOptions> quota = Parse({"--uid-quota", "12Q"});
  ASSERT_FALSE(quota.ok());
  EXPECT_TRUE(absl::StartsWith(quota.status().message(), "--uid-quota = \"12Q\""))
      << quota.status();
  absl::StatusOr<DaemonOptions> missing = Parse({"--uid-leases"});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "--uid-leases: needs a value");
}

TEST(UidLimitOptionsTest, AllowGidTakesAGroupNameOrANumber) {
  // The packaged config names its group: allow-gid = ["tensorshm"].
  absl::StatusOr<DaemonOptions> named = Parse({"--allow-gid", "nogroup", "--allow-gid", "0"});
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->allow_gids, (std::set<gid_t>{0, 65534}));
  absl::StatusOr<DaemonOptions> unknown = Parse({"--allow-gid", "no-such-group-here"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.status().message(), "--allow-gid = \"no-such-group-here\": no such group");
}

}  // namespace
}  // namespace tensorshm
