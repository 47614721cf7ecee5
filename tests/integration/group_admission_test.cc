// --allow-gid GROUP (issue 37): the daemon admits the members of a group given by name, whether
// it is their primary group or a supplementary one (SO_PEERGROUPS: the groups the kernel
// recorded at connect), and refuses anyone else naming the group and how to join it: the way the
// packaged daemon admits the group `tensorshm`. A real daemon, real client processes run as other
// uids with setpriv.
#include <sys/stat.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int kNogroup = 65534;  // Debian's group "nogroup"

// Runs tsm_share_client's put of one 4 KiB tensor as uid `uid` with primary group `gid` and the
// supplementary groups `groups` ("" for none); returns its output.
std::string PutAs(const TestDaemon& daemon, int uid, int gid, const std::string& groups) {
  std::vector<std::string> argv = {"/usr/bin/setpriv", absl::StrCat("--reuid=", uid),
                                   absl::StrCat("--regid=", gid)};
  argv.push_back(groups.empty() ? "--clear-groups" : absl::StrCat("--groups=", groups));
  argv.insert(argv.end(), {TSM_SHARE_CLIENT_PATH, "put", daemon.socket(), absl::StrCat("uid", uid),
                           "0", "1", "4096"});
  return RunToEnd(argv, absl::StrCat(daemon.dir(), "/put-", uid, "-", gid, ".log"));
}

TEST(GroupAdmissionTest, MembersByEitherGroupAreAdmittedOthersAreToldTheGroup) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run clients as other uids (setpriv)";
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("groupadmit", {"--allow-gid", "nogroup", "--uid-tensors", "0"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_EQ(chmod(daemon->dir().c_str(), 0755), 0);  // the socket's directory, for other uids

  const std::string supplementary = PutAs(*daemon, 12345, 12345, std::to_string(kNogroup));
  EXPECT_TRUE(absl::StrContains(supplementary, "put 1")) << supplementary;
  const std::string primary = PutAs(*daemon, 12346, kNogroup, "");
  EXPECT_TRUE(absl::StrContains(primary, "put 1")) << primary;

  const std::string stranger = PutAs(*daemon, 12347, 12347, "");
  std::cout << "stranger: " << stranger;
  EXPECT_TRUE(absl::StrContains(stranger, "uid 12347, gid 12347")) << stranger;
  EXPECT_TRUE(absl::StrContains(stranger, "may not use this tensorshmd")) << stranger;
  EXPECT_TRUE(absl::StrContains(stranger, "the members of group nogroup (--allow-gid)"))
      << stranger;
  EXPECT_TRUE(absl::StrContains(stranger, "usermod -aG nogroup USER")) << stranger;
  EXPECT_FALSE(absl::StrContains(stranger, "put 1")) << stranger;
}

}  // namespace
}  // namespace tensorshm::testing
