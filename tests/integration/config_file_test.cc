// tensorshmd's --config file (TOML keyed by the long flag names): what it sets, what the command
// line overrides, what it refuses, and a real daemon started from one.
#include "server/ops/config_file.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/ops/options.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm {
namespace {

class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(std::filesystem::temp_directory_path().string(), "/tsm-config-test-",
                        getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes `text` to a new file in the test's directory and returns its path.
  std::string Write(const std::string& text) {
    const std::string path = absl::StrCat(dir_, "/config-", ++files_, ".toml");
    std::ofstream(path) << text;
    return path;
  }

  static absl::StatusOr<DaemonOptions> Parse(std::vector<std::string> args) {
    args.insert(args.begin(), "tensorshmd");
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    return ParseOptions(static_cast<int>(argv.size()), argv.data());
  }

  std::string dir_;
  int files_ = 0;
};

TEST_F(ConfigFileTest, EveryKindOfKeySetsItsFlag) {
  const std::string path = Write(R"(# a daemon for the tests
socket = "/run/tensorshm/x.sock"
host-pool = "3Gi"
segment-size = "67108864B"
max-tensors = 100
keep-segments = true
shm-prefix = "fixed"
allow-uid = [1000, 1001]
allow-gid = 50
cuda-pool = ["cuda:0=1Gi", "cuda:1=2Gi"]
log-level = "debug"
uid-quota = "1Gi"
)");
  absl::StatusOr<DaemonOptions> options = Parse({"--config", path});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->config_file, path);
  EXPECT_EQ(options->socket, "/run/tensorshm/x.sock");
  EXPECT_EQ(options->host_pool_bytes, 3ull << 30);
  EXPECT_EQ(options->segment_bytes, 64u << 20);
  EXPECT_EQ(options->max_tensors, 100u);
  EXPECT_TRUE(options->keep_segments);
  EXPECT_EQ(options->shm_prefix, "fixed");
  EXPECT_EQ(options->allow_uids, (std::set<uid_t>{1000, 1001}));
  EXPECT_EQ(options->allow_gids, (std::set<gid_t>{50}));
  ASSERT_EQ(options->cuda_pools.size(), 2u);
  EXPECT_EQ(options->cuda_pools[1].ordinal, 1);
  EXPECT_EQ(options->log_level, LogLevel::kDebug);
  EXPECT_EQ(options->uid_limits.unpublished_bytes, 1ull << 30);
}

TEST_F(ConfigFileTest, TheCommandLineOverridesTheFile) {
  const std::string path = Write(
      "host-pool = \"3Gi\"\nmax-tensors = 100\nallow-uid = [1000, 1001]\nkeep-segments = true\n"
      "log-level = \"debug\"\n");
  // Before and after --config alike: the command line wins, flag by flag.
  absl::StatusOr<DaemonOptions> options =
      Parse({"--host-pool", "1Gi", "--config", path, "--allow-uid", "7", "--keep-segments=false"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->host_pool_bytes, 1ull << 30);
  EXPECT_EQ(options->allow_uids, (std::set<uid_t>{7}));  // the list is replaced, not extended
  EXPECT_FALSE(options->keep_segments);
  // What the command line does not name comes from the file.
  EXPECT_EQ(options->max_tensors, 100u);
  EXPECT_EQ(options->log_level, LogLevel::kDebug);
}

TEST_F(ConfigFileTest, BadFilesAreRefusedNamingFileKeyAndValue) {
  struct Case {
    std::string text;
    std::vector<std::string> expected;  // each is in the message
  };
  const std::vector<Case> cases = {
      {"host-pool = \"12Q\"\n", {"--host-pool = \"12Q\"", "unknown unit", "Mi"}},
      // A number without a unit was once bytes: "host-pool = 1024" made a 4 KiB pool.
      {"host-pool = 1024\n", {"--host-pool = \"1024\"", "needs a unit", "1024B", "Gi"}},
      {"segment-size = \"4096\"\n", {"--segment-size = \"4096\"", "needs a unit"}},
      {"hostpool = \"1Gi\"\n", {"unknown key \"hostpool\""}},
      {"[daemon]\nhost-pool = \"1Gi\"\n", {"unknown key \"daemon\""}},
      {"config = \"other.toml\"\n", {"unknown key \"config\""}},
      {"keep-segments = \"yes\"\n", {"keep-segments = \"yes\"", "true or false"}},
      {"max-tensors = 1.5\n", {"max-tensors = 1.5", "a string or a whole number"}},
      {"host-pool = [\"1Gi\"]\n", {"host-pool", "a string or a whole number"}},
      {"allow-uid = [\"me\"]\n", {"--allow-uid = \"me\"", "numeric uid"}},
      {"host-pool = \n", {"not TOML", "missing value"}},
      {"max-tensors = 0\n", {"--max-tensors = \"0\""}},
  };
  for (const Case& c : cases) {
    const std::string path = Write(c.text);
    absl::StatusOr<DaemonOptions> options = Parse({"--config", path});
    ASSERT_FALSE(options.ok()) << c.text;
    EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    const std::string message(options.status().message());
    std::cout << message << "\n";
    EXPECT_TRUE(absl::StrContains(message, path)) << message;
    for (const std::string& part : c.expected) {
      EXPECT_TRUE(absl::StrContains(message, part)) << "missing \"" << part << "\": " << message;
    }
  }
  // A value the command line overrides is not checked: the flag replaces it.
  const std::string bad_pool = Write("host-pool = \"12Q\"\n");
  EXPECT_TRUE(Parse({"--config", bad_pool, "--host-pool", "1Gi"}).ok());
}

TEST_F(ConfigFileTest, AFileThatCannotBeReadIsNamed) {
  const std::string missing = dir_ + "/missing.toml";
  absl::StatusOr<DaemonOptions> options = Parse({"--config", missing});
  ASSERT_FALSE(options.ok());
  EXPECT_EQ(options.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(options.status().message(), missing)) << options.status();
  absl::StatusOr<DaemonOptions> no_value = Parse({"--config"});
  ASSERT_FALSE(no_value.ok());
  EXPECT_EQ(no_value.status().message(), "--config: needs a value");
}

TEST_F(ConfigFileTest, EveryFlagIsAKeyAndInTheHelp) {
  const std::string usage = Usage();
  for (const FlagSpec& flag : DaemonFlags()) {
    EXPECT_TRUE(absl::StrContains(usage, absl::StrCat("--", flag.name))) << flag.name;
  }
  EXPECT_TRUE(absl::StrContains(usage, "--config FILE"));
}

// A real tensorshmd takes its pool from the file, or from the flag when both give one.
TEST_F(ConfigFileTest, TheDaemonServesWithTheFilesSettings) {
  const std::string path =
      Write("host-pool = \"8Mi\"\nsegment-size = \"2Mi\"\nlog-level = \"info\"\n");
  for (const bool override_pool : {false, true}) {
    std::vector<std::string> args = {"--config", path};
    if (override_pool) args.insert(args.end(), {"--host-pool", "4Mi"});
    absl::StatusOr<testing::TestDaemon> daemon = testing::TestDaemon::Start("config", args);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    ClientOptions client_options;
    client_options.socket = daemon->socket();
    tensorshm::StatusOr<std::shared_ptr<Client>> client = Client::Connect(client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_FALSE(stats->pools.empty());
    EXPECT_EQ(stats->pools[0].capacity_bytes, int64_t{override_pool ? 4 : 8} << 20);
    // TestDaemon's --log-level warning, after --config, wins over the file's info: no info line
    // but the start-up line, which is logged whatever the level.
    int info_lines = 0;
    for (absl::string_view line : absl::StrSplit(daemon->process().Output(), '\n')) {
      if (absl::StrContains(line, " info: ") && !absl::StrContains(line, ": serving on unix:")) {
        ++info_lines;
      }
    }
    EXPECT_EQ(info_lines, 0) << daemon->process().Output();
    // The start-up line says the segment size in effect.
    EXPECT_TRUE(
        absl::StrContains(daemon->process().Output(),
                          "shm segments of up to 2 MiB (a larger tensor gets one of its own size)"))
        << daemon->process().Output();
  }
}

// The start-up line goes to the log (stderr) like every other line, whatever --log-level, and
// says the segment size in effect: never larger than the pool (issue 21: with --host-pool 64Mi
// it said "segments of 256 MiB", on stdout).
TEST_F(ConfigFileTest, TheStartupLineIsLoggedWithTheSegmentSizeInEffect) {
  const std::string dir = dir_ + "/startup";
  std::filesystem::create_directories(dir);
  const std::string prefix = absl::StrCat("tsmtest-startup-", getpid());
  absl::StatusOr<testing::ChildProcess> daemon = testing::ChildProcess::Start(
      {"/bin/sh", "-c",
       absl::StrCat("exec ", testing::TensorShmdPath(), " --socket ", dir, "/s.sock",
                    " --shm-prefix ", prefix, " --host-pool 64Mi --log-level error 2>", dir,
                    "/stderr.log")},
      dir + "/stdout.log");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  std::string err;
  for (int i = 0; i < 400 && !absl::StrContains(err, "serving on"); ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    std::ifstream file(dir + "/stderr.log");
    err.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  }
  std::cout << err;
  EXPECT_TRUE(absl::StrContains(err, " tensorshmd info: tensorshmd ")) << err;
  EXPECT_TRUE(absl::StrContains(err,
                                "host pool 64 MiB in shm segments of up to 64 MiB, shm "
                                "prefix /" +
                                    prefix))
      << err;
  daemon->Kill(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(30)).ok());
  EXPECT_EQ(daemon->Output(), "");  // nothing on stdout
}

}  // namespace
}  // namespace tensorshm
