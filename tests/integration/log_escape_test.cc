// Client-supplied strings in the daemon's log: a client name with a newline and a forged log
// line after it is logged as one line, escaped.
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

TEST(LogEscapeTest, ClientNameWithANewlineIsOneEscapedLine) {
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start("logescape", {"--log-level", "info"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string forged = "2030-01-01T00:00:00.000Z tensorshmd error: forged by a client";
  {
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon->socket(), "evil\n" + forged + "\x01\"end"});
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->Stat().ok());
  }
  ASSERT_TRUE(daemon->process().WaitForOutput(" closed: ", absl::Seconds(10)))
      << daemon->process().Output();
  const std::string output = daemon->process().Output();
  int opened = 0;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    EXPECT_FALSE(absl::StartsWith(line, "2030-01-01")) << "a forged line: " << line;
    if (absl::StrContains(line, " opened: ")) {
      ++opened;
      EXPECT_TRUE(absl::StrContains(line, "client \"evil\\n" + forged + "\\x01\\\"end\"")) << line;
    }
  }
  EXPECT_EQ(opened, 1) << output;
}

}  // namespace
}  // namespace tensorshm::testing
