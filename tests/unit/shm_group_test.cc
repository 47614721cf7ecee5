// --shm-group's parts without a daemon: the flag's value (server/ops/shm_group.cc), its place
// among the options, and what ShmSegment makes and takes back with a group.
#include "server/ops/shm_group.h"

#include <grp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/memory/shm_segment.h"
#include "server/ops/options.h"

namespace tensorshm {
namespace {

#define ASSERT_OK(expr) ASSERT_TRUE((expr).ok()) << (expr).status()

absl::StatusOr<DaemonOptions> Parse(std::vector<const char*> argv) {
  argv.insert(argv.begin(), "tensorshmd");
  return ParseOptions(static_cast<int>(argv.size()), const_cast<char**>(argv.data()));
}

TEST(ParseShmGroupTest, ANameOrANumber) {
  // This process's own group, by name and by number.
  const struct group* own = getgrgid(getegid());
  ASSERT_NE(own, nullptr) << "gid " << getegid() << " has no name";
  const std::string own_name = own->gr_name;
  absl::StatusOr<ShmGroup> by_name = ParseShmGroup(own_name);
  ASSERT_OK(by_name);
  EXPECT_EQ(by_name->gid, getegid());
  EXPECT_EQ(by_name->name, own_name);
  absl::StatusOr<ShmGroup> by_number = ParseShmGroup(std::to_string(getegid()));
  ASSERT_OK(by_number);
  EXPECT_EQ(by_number->gid, getegid());
  EXPECT_EQ(by_number->name, own_name);
  EXPECT_EQ(GroupName(getegid()), own_name);

  // A number is a gid whether or not a group of that number is known here (a container may not
  // know the host's groups).
  constexpr gid_t kUnnamed = 4242;
  if (getgrgid(kUnnamed) == nullptr) {
    absl::StatusOr<ShmGroup> unnamed = ParseShmGroup("4242");
    ASSERT_OK(unnamed);
    EXPECT_EQ(unnamed->gid, kUnnamed);
    EXPECT_EQ(unnamed->name, "4242");
    EXPECT_EQ(GroupName(kUnnamed), "4242");
  }
}

TEST(ParseShmGroupTest, BadValuesNameTheFlagAndTheValue) {
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {"tsm-nosuchgroup", "no such group"},
           {"", "expected a group name or a numeric gid"},
           {"-1", "no such group"},
           {"4294967295", "not a gid"},
           {"99999999999", "no such group"},
       }) {
    absl::StatusOr<ShmGroup> group = ParseShmGroup(text);
    ASSERT_FALSE(group.ok()) << text;
    EXPECT_EQ(group.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(group.status().message(),
              absl::StrCat("--shm-group = \"", text,
                           "\": ", why == "not a gid" ? "not a gid (4294967295 means none)" : why))
        << group.status();
  }
}

TEST(ParseShmGroupTest, OptionsTakeItButNotWithMemfdSegments) {
  absl::StatusOr<DaemonOptions> none = Parse({});
  ASSERT_OK(none);
  EXPECT_FALSE(none->shm_group.has_value());
  const std::string gid = std::to_string(getegid());
  absl::StatusOr<DaemonOptions> given = Parse({"--shm-group", gid.c_str()});
  ASSERT_OK(given);
  ASSERT_TRUE(given->shm_group.has_value());
  EXPECT_EQ(given->shm_group->gid, getegid());

  absl::StatusOr<DaemonOptions> memfd = Parse({"--segments", "memfd", "--shm-group", gid.c_str()});
  ASSERT_FALSE(memfd.ok());
  EXPECT_EQ(memfd.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(memfd.status().message());
  std::cout << message << "\n";
  EXPECT_TRUE(absl::StartsWith(message, "--shm-group = \"")) << message;
  EXPECT_TRUE(absl::StrContains(message, "with --segments memfd: memfd segments have no name"))
      << message;

  // A --config key like every flag: a name (a string) or a gid (a string or a TOML integer).
  const std::string config = absl::StrCat(::testing::TempDir(), "/shm_group_", getpid(), ".toml");
  for (const std::string& value : {gid, "\"" + gid + "\""}) {
    std::ofstream(config) << "shm-group = " << value << "\n";
    absl::StatusOr<DaemonOptions> from_file = Parse({"--config", config.c_str()});
    ASSERT_OK(from_file);
    ASSERT_TRUE(from_file->shm_group.has_value()) << value;
    EXPECT_EQ(from_file->shm_group->gid, getegid());
  }
  std::remove(config.c_str());

  absl::StatusOr<DaemonOptions> unknown = Parse({"--shm-group", "tsm-nosuchgroup"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().message(), "--shm-group = \"tsm-nosuchgroup\": no such group");

  // Its own group is one a process can always give its objects to.
  EXPECT_TRUE(CheckCanGiveToGroup(ShmGroup{getegid(), "own"}).ok());
}

// ---- ShmSegment with a group ----

class GroupSegmentTest : public ::testing::Test {
 protected:
  void SetUp() override { shm_unlink(name_.c_str()); }
  void TearDown() override { shm_unlink(name_.c_str()); }
  struct stat Stat() const {
    struct stat st {};
    EXPECT_EQ(stat(path_.c_str(), &st), 0) << path_;
    return st;
  }

  const std::string name_ = absl::StrCat("/tsmunit-group-", getpid(), ".cpu.1");
  const std::string path_ = "/dev/shm" + name_;
};

TEST_F(GroupSegmentTest, CreatedWithAGroupIs0660WithIt) {
  const gid_t group = getegid();
  umask(077);  // as tensorshmd runs: the mode is set whatever the umask
  absl::StatusOr<ShmSegment> segment =
      ShmSegment::Create(name_, 1 << 16, /*map=*/false, SegmentBacking::kNamed, group);
  ASSERT_OK(segment);
  EXPECT_EQ(Stat().st_mode & 07777, kGroupSegmentMode);
  EXPECT_EQ(Stat().st_gid, group);
  segment->Keep();
  segment = absl::UnknownError("closed");
  // Taken back with the group, refused without it: its members could have written it.
  absl::StatusOr<ShmSegment> with = ShmSegment::Open(name_, /*map=*/false, group);
  ASSERT_OK(with);
  with->Keep();
  with = absl::UnknownError("closed");
  absl::StatusOr<ShmSegment> without = ShmSegment::Open(name_, /*map=*/false);
  ASSERT_FALSE(without.ok());
  EXPECT_EQ(without.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string message(without.status().message());
  std::cout << message << "\n";
  for (const std::string& part :
       {path_ + ": owned by uid " + std::to_string(geteuid()), std::string("mode 0660"),
        absl::StrCat("group ", GroupName(group), " (gid ", group, ")"),
        std::string("a tensorshmd without --shm-group does not take it back"),
        "restart with --shm-group " + GroupName(group), "rm " + path_}) {
    EXPECT_TRUE(absl::StrContains(message, part)) << part << " | " << message;
  }
  EXPECT_EQ(Stat().st_mode & 07777, kGroupSegmentMode) << "a refusal changed the object";
}

TEST_F(GroupSegmentTest, APrivateSegmentTakenBackWithAGroupJoinsIt) {
  const gid_t group = getegid();
  absl::StatusOr<ShmSegment> segment = ShmSegment::Create(name_, 1 << 16, /*map=*/false);
  ASSERT_OK(segment);
  EXPECT_EQ(Stat().st_mode & 07777, kSegmentMode);
  segment->Keep();
  segment = absl::UnknownError("closed");
  absl::StatusOr<ShmSegment> with = ShmSegment::Open(name_, /*map=*/true, group);
  ASSERT_OK(with);
  EXPECT_EQ(Stat().st_mode & 07777, kGroupSegmentMode);
  EXPECT_EQ(Stat().st_gid, group);
}

TEST_F(GroupSegmentTest, AnotherGroupsSegmentOrAnotherModeIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give an object to a group it is not in";
  absl::StatusOr<ShmSegment> segment =
      ShmSegment::Create(name_, 1 << 16, /*map=*/false, SegmentBacking::kNamed, 4242);
  ASSERT_OK(segment);
  segment->Keep();
  segment = absl::UnknownError("closed");
  absl::StatusOr<ShmSegment> other = ShmSegment::Open(name_, /*map=*/false, 4343);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(other.status().message(),
                                "a tensorshmd with --shm-group " + GroupName(4343)))
      << other.status();
  EXPECT_TRUE(
      absl::StrContains(other.status().message(), "restart with --shm-group " + GroupName(4242)))
      << other.status();
  EXPECT_EQ(Stat().st_gid, 4242u);

  // Modes tensorshmd never gives (group-readable only, or open to others) stay refused.
  for (mode_t mode : {0640, 0666, 0620}) {
    ASSERT_EQ(chmod(path_.c_str(), mode), 0);
    absl::StatusOr<ShmSegment> refused = ShmSegment::Open(name_, /*map=*/false, 4242);
    ASSERT_FALSE(refused.ok()) << std::oct << mode;
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "not of the mode"))
        << refused.status();
    EXPECT_EQ(Stat().st_mode & 07777, mode);
  }
}

}  // namespace
}  // namespace tensorshm
