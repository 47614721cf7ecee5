// The Sessions RPC (Client::Sessions) and what it and List show to whom; the publish time in
// TensorInfo, also after a restart that recovered the tensors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tensorshm/client.h"
#include "tests/support/ctl_run.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

#define ASSERT_OK(x) ASSERT_TRUE((x).ok()) << (x).status()

constexpr int kNobody = 65534;

ChildProcess StartPeer(const TestDaemon& daemon, const std::vector<std::string>& args,
                       const std::string& log) {
  std::vector<std::string> argv = {PeerPath(), args.at(0), daemon.socket()};
  argv.insert(argv.end(), args.begin() + 1, args.end());
  absl::StatusOr<ChildProcess> child = ChildProcess::Start(argv, daemon.dir() + "/" + log);
  EXPECT_TRUE(child.ok()) << child.status();
  return *std::move(child);
}

const SessionInfo* FindPid(const std::vector<SessionInfo>& sessions, int64_t pid) {
  for (const SessionInfo& s : sessions) {
    if (s.pid == pid) return &s;
  }
  return nullptr;
}

TEST(SessionsRpcTest, FieldsOfAKnownClientProcessAndOfTheCallersOwnSession) {
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start("sessions-fields");
  ASSERT_OK(daemon);
  const int64_t before = absl::ToUnixMillis(absl::Now());
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon->socket(), "sessions_test"});
  ASSERT_OK(client);
  tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLFloat, 32, 1}, {16}});
  ASSERT_OK(w);
  ASSERT_TRUE((*client)->Publish(*w, "x").ok());
  ChildProcess holder = StartPeer(*daemon, {"hold", "x"}, "holder.log");
  ASSERT_TRUE(holder.WaitForOutput("held", absl::Seconds(30))) << holder.Output();
  // An unpublished buffer of this session: counted with its page-rounded bytes.
  tensorshm::StatusOr<WritableTensor> pending = (*client)->Create({{kDLUInt, 8, 1}, {5000}});
  ASSERT_OK(pending);
  const int64_t after = absl::ToUnixMillis(absl::Now());

  tensorshm::StatusOr<std::vector<SessionInfo>> sessions = (*client)->Sessions();
  ASSERT_OK(sessions);
  ASSERT_EQ(sessions->size(), 2u);
  EXPECT_LT((*sessions)[0].session_id, (*sessions)[1].session_id);  // by id

  const SessionInfo* hold = FindPid(*sessions, holder.pid());
  ASSERT_NE(hold, nullptr);
  EXPECT_GT(hold->session_id, 0u);
  EXPECT_EQ(hold->uid, geteuid());
  EXPECT_EQ(hold->gid, getegid());
  EXPECT_EQ(hold->client_name, "tsm_peer-hold");
  EXPECT_EQ(hold->client_version, TENSORSHM_VERSION);
  EXPECT_EQ(hold->rpc_leases + hold->page_leases, 1);
  EXPECT_EQ(hold->unpublished_tensors, 0);
  EXPECT_EQ(hold->unpublished_bytes, 0);
  EXPECT_EQ(hold->waiting_acquires, 0);
  EXPECT_GE(hold->opened_unix_ms, before);
  EXPECT_LE(hold->opened_unix_ms, after);
  EXPECT_FALSE(hold->own);
  EXPECT_FALSE(hold->redacted);

  const SessionInfo* own = FindPid(*sessions, getpid());
  ASSERT_NE(own, nullptr);
  EXPECT_TRUE(own->own);
  EXPECT_EQ(own->client_name, "sessions_test");
  EXPECT_EQ(own->rpc_leases + own->page_leases, 0);
  EXPECT_GE(own->unpublished_tensors, 1);  // plus any buffers the daemon stocked for it
  EXPECT_GE(own->unpublished_bytes, 5000);
  EXPECT_EQ(own->unpublished_bytes % getpagesize(), 0);

  // Publishing the pending buffer takes it off the count.
  const int64_t unpublished_before = own->unpublished_tensors;
  ASSERT_TRUE((*client)->Publish(*pending, "y").ok());
  sessions = (*client)->Sessions();
  ASSERT_OK(sessions);
  EXPECT_EQ(FindPid(*sessions, getpid())->unpublished_tensors, unpublished_before - 1);

  // The publisher of a tensor, as List reports it.
  tensorshm::StatusOr<std::vector<TensorInfo>> list = (*client)->List("x");
  ASSERT_OK(list);
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].publisher_uid, geteuid());
  EXPECT_EQ((*list)[0].publisher_pid, getpid());
  EXPECT_GE((*list)[0].published_unix_ms, before);
  EXPECT_LE((*list)[0].published_unix_ms, after);
}

// With --allow-uid, uid 65534 shares the daemon with its owner (root here). The owner sees every
// session whole; 65534 sees its own whole and the owner's with pid, gid and client name withheld,
// but with their uid and counts; the pids of the owner's publishers are withheld from List too.
TEST(SessionsRpcTest, AnotherUidSeesOthersSessionsRedactedAndTheOwnerSeesAll) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("sessions-redact", {"--allow-uid", std::to_string(kNobody)});
  ASSERT_OK(daemon);
  chmod(daemon->dir().c_str(), 0755);
  tensorshm::StatusOr<std::shared_ptr<Client>> owner =
      Client::Connect(ClientOptions{daemon->socket(), "owner-client"});
  ASSERT_OK(owner);
  tensorshm::StatusOr<WritableTensor> w = (*owner)->Create({{kDLInt, 32, 1}, {8}});
  ASSERT_OK(w);
  ASSERT_TRUE((*owner)->Publish(*w, "owned").ok());
  tensorshm::StatusOr<DLManagedTensorVersioned*> held = (*owner)->Acquire("owned");
  ASSERT_OK(held);
  ChildProcess nobody = StartPeer(*daemon, {"hold", "owned", "--as-uid", "65534"}, "nobody.log");
  ASSERT_TRUE(nobody.WaitForOutput("held", absl::Seconds(30))) << nobody.Output();

  // The owner sees the other uid's session whole.
  tensorshm::StatusOr<std::vector<SessionInfo>> seen = (*owner)->Sessions();
  ASSERT_OK(seen);
  const SessionInfo* theirs = FindPid(*seen, nobody.pid());
  ASSERT_NE(theirs, nullptr);
  EXPECT_EQ(theirs->uid, static_cast<uint32_t>(kNobody));
  EXPECT_EQ(theirs->gid, static_cast<uint32_t>(kNobody));
  EXPECT_EQ(theirs->client_name, "tsm_peer-hold");
  EXPECT_FALSE(theirs->redacted);

  // Uid 65534's view, through tensorshmctl run as that uid.
  CtlRun run =
      RunCtl(daemon->dir(), {"--socket", daemon->socket(), "sessions", "-o", "json"}, {}, kNobody);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::cout << run.out;
  const nlohmann::json sessions = run.Json()["sessions"];
  ASSERT_EQ(sessions.size(), 3u) << run.out;  // the owner's client, the holder, tensorshmctl
  int redacted = 0;
  for (const nlohmann::json& s : sessions) {
    if (s["uid"] == 0) {
      ++redacted;
      EXPECT_EQ(s["redacted"], true) << s;
      EXPECT_TRUE(s["pid"].is_null()) << s;
      EXPECT_TRUE(s["gid"].is_null()) << s;
      EXPECT_TRUE(s["client_name"].is_null()) << s;
      EXPECT_TRUE(s["client_version"].is_null()) << s;
      EXPECT_EQ(s["leases"], 1) << s;  // counts stay
      EXPECT_EQ(s["own"], false) << s;
    } else {
      EXPECT_EQ(s["uid"], kNobody) << s;
      EXPECT_EQ(s["redacted"], false) << s;
      EXPECT_FALSE(s["pid"].is_null()) << s;
      EXPECT_FALSE(s["client_name"].is_null()) << s;
    }
  }
  EXPECT_EQ(redacted, 1);
  nlohmann::json holder;
  for (const nlohmann::json& s : sessions) {
    if (s["pid"] == nobody.pid()) holder = s;
  }
  ASSERT_FALSE(holder.is_null()) << run.out;
  EXPECT_EQ(holder["client_name"], "tsm_peer-hold");
  EXPECT_EQ(holder["leases"], 1);

  CtlRun text = RunCtl(daemon->dir(), {"--socket", daemon->socket(), "sessions"}, {}, kNobody);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  std::cout << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, "(another uid's)")) << text.out;
  EXPECT_FALSE(absl::StrContains(text.out, "owner-client")) << text.out;

  // List: the owner's tensor shows its publisher's uid, not its pid, to uid 65534.
  CtlRun inspect = RunCtl(
      daemon->dir(), {"--socket", daemon->socket(), "inspect", "owned", "-o", "json"}, {}, kNobody);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_EQ(inspect.Json()["publisher_uid"], 0);
  EXPECT_TRUE(inspect.Json()["publisher_pid"].is_null()) << inspect.out;
  CtlRun own_view =
      RunCtl(daemon->dir(), {"--socket", daemon->socket(), "inspect", "owned", "-o", "json"});
  EXPECT_EQ(own_view.Json()["publisher_pid"], getpid()) << own_view.out;
  (*held)->deleter(*held);
}

// Without --allow-uid another uid gets nothing: PERMISSION_DENIED, exit 1.
TEST(SessionsRpcTest, AnUnadmittedUidIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start("sessions-refused");
  ASSERT_OK(daemon);
  chmod(daemon->dir().c_str(), 0755);
  chmod(daemon->socket().c_str(), 0666);
  CtlRun run = RunCtl(daemon->dir(), {"--socket", daemon->socket(), "sessions"}, {}, kNobody);
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(run.err, "PERMISSION_DENIED")) << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "uid 65534")) << run.err;
  EXPECT_EQ(run.out, "");
  std::cout << run.err;
}

// The publish time is kept in the tensor's record: a daemon that recovers a killed daemon's
// tensors reports the original time (the publisher's pid it cannot know).
TEST(SessionsRpcTest, PublishTimeSurvivesARecoveringRestart) {
  absl::StatusOr<TestDaemon> first = TestDaemon::Start("sessions-recover", {"--keep-segments"});
  ASSERT_OK(first);
  int64_t published = 0;
  {
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{first->socket(), "sessions_test"});
    ASSERT_OK(client);
    tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLFloat, 32, 1}, {64}});
    ASSERT_OK(w);
    ASSERT_TRUE((*client)->Publish(*w, "kept").ok());
    tensorshm::StatusOr<std::vector<TensorInfo>> list = (*client)->List("kept");
    ASSERT_OK(list);
    ASSERT_EQ(list->size(), 1u);
    published = (*list)[0].published_unix_ms;
    ASSERT_GT(published, 0);
  }
  first->KillOnPurpose(SIGKILL);
  ASSERT_TRUE(first->process().Wait(absl::Seconds(30)).ok());

  // A second daemon with the same prefix and socket recovers the segments.
  std::filesystem::remove(first->socket());
  absl::StatusOr<ChildProcess> second =
      ChildProcess::Start({TensorShmdPath(), "--socket", first->socket(), "--shm-prefix",
                           first->shm_prefix(), "--log-level", "warning"},
                          first->dir() + "/second.log");
  ASSERT_OK(second);
  ASSERT_TRUE(second->WaitForOutput("serving on", absl::Seconds(20))) << second->Output();
  CtlRun run = RunCtl(first->dir(), {"--socket", first->socket(), "inspect", "kept", "-o", "json"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.Json()["published_unix_ms"], published) << run.out;
  EXPECT_TRUE(run.Json()["publisher_pid"].is_null()) << run.out;
  second->Kill(SIGTERM);  // without --keep-segments: removes the objects
  ASSERT_TRUE(second->Wait(absl::Seconds(30)).ok());
  EXPECT_EQ(first->ShmObjectCount(), 0);
}

}  // namespace
}  // namespace tensorshm::testing
