// tensorshmctl against a real tensorshmd: every subcommand, text and JSON, with tensors published
// by real clients (this process and tsm_peer processes), and its bad usage.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
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

constexpr int64_t kPoolBytes = 64 << 20;

class CtlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    absl::StatusOr<TestDaemon> daemon =
        TestDaemon::Start("ctl-" + name.substr(0, 20), {"--host-pool", "64Mi"});
    ASSERT_OK(daemon);
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "ctl_test"});
    ASSERT_OK(client);
    client_ = *client;
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();
  }

  // tensorshmctl --socket <the daemon's> ARGS.
  CtlRun Ctl(std::vector<std::string> args) {
    args.insert(args.begin(), {"--socket", daemon_->socket()});
    return RunCtl(daemon_->dir(), args);
  }

  // Publishes an int16 tensor of `shape` (strides in elements, empty: C order) under `name`.
  void Publish(const std::string& name, std::vector<int64_t> shape,
               std::vector<int64_t> strides = {}) {
    tensorshm::StatusOr<WritableTensor> w = client_->Create({{kDLInt, 16, 1}, shape, strides});
    ASSERT_OK(w);
    ASSERT_TRUE(client_->Publish(*w, name).ok());
  }

  ChildProcess StartPeer(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {PeerPath(), args.at(0), daemon_->socket()};
    argv.insert(argv.end(), args.begin() + 1, args.end());
    absl::StatusOr<ChildProcess> child =
        ChildProcess::Start(argv, absl::StrCat(daemon_->dir(), "/peer-", ++peers_, ".log"));
    EXPECT_TRUE(child.ok()) << child.status();
    return *std::move(child);
  }

  // The entry of `list` whose `key` is `value`, or null.
  static nlohmann::json Find(const nlohmann::json& list, const std::string& key,
                             const nlohmann::json& value) {
    for (const nlohmann::json& entry : list) {
      if (entry.contains(key) && entry[key] == value) return entry;
    }
    return nullptr;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
  int peers_ = 0;
};

TEST_F(CtlTest, StatusReportsPoolsTensorsNamesLeasesAndSessions) {
  Publish("a", {4, 5});
  Publish("b", {1000});
  tensorshm::StatusOr<DLManagedTensorVersioned*> held = client_->Acquire("a");
  ASSERT_OK(held);

  CtlRun json = Ctl({"status", "-o", "json"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json report = json.Json();
  tensorshm::StatusOr<ServerStats> stats = client_->Stat();
  ASSERT_OK(stats);
  std::cout << json.out;
  EXPECT_EQ(report["tensors"], 2);
  EXPECT_EQ(report["names"], 2);
  EXPECT_EQ(report["leases"], 1);
  EXPECT_EQ(report["sessions"], 2);  // this test's client and tensorshmctl's own
  ASSERT_EQ(report["pools"].size(), 1u);
  const nlohmann::json& pool = report["pools"][0];
  EXPECT_EQ(pool["device"], "cpu");
  EXPECT_EQ(pool["device_type"], kDLCPU);
  EXPECT_EQ(pool["capacity_bytes"], kPoolBytes);
  EXPECT_EQ(pool["used_bytes"], stats->pools[0].used_bytes);
  EXPECT_GE(pool["used_bytes"].get<int64_t>(), 40 + 2000);
  EXPECT_EQ(pool["segments"], stats->pools[0].segments);
  EXPECT_GE(pool["segments"].get<int64_t>(), 1);
  EXPECT_EQ(pool["stock_bytes"], stats->pools[0].stock_bytes);
  EXPECT_EQ(report["stocked_tensors"], stats->stocked_tensors);

  CtlRun text = Ctl({"status"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  std::cout << text.out;
  EXPECT_EQ(LineWith(text.out, "tensors"), "tensors   2");
  EXPECT_EQ(LineWith(text.out, "leases"), "leases    1");
  EXPECT_TRUE(absl::StartsWith(LineWith(text.out, "cpu "), "cpu     64.0 MiB")) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, "DEVICE  CAPACITY")) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, "USE%  STOCK")) << text.out;
  EXPECT_EQ(LineWith(text.out, "stocked"), "stocked   0") << text.out;
  (*held)->deleter(*held);
}

TEST_F(CtlTest, LsShowsDtypeShapeBytesAndLeasesThatMoveWithALease) {
  const int64_t before = absl::ToUnixMillis(absl::Now());
  Publish("models/w1", {4, 5});
  Publish("models/w2", {3});
  Publish("other", {2, 2, 2});
  const int64_t after = absl::ToUnixMillis(absl::Now());

  CtlRun all = Ctl({"ls", "-o", "json"});
  ASSERT_EQ(all.exit_code, 0) << all.err;
  const nlohmann::json tensors = all.Json()["tensors"];
  ASSERT_EQ(tensors.size(), 3u) << all.out;
  const nlohmann::json w1 = Find(tensors, "name", "models/w1");
  ASSERT_FALSE(w1.is_null()) << all.out;
  EXPECT_EQ(w1["dtype"], "int16");
  EXPECT_EQ(w1["shape"], nlohmann::json({4, 5}));
  EXPECT_EQ(w1["nbytes"], 40);
  EXPECT_EQ(w1["device"], "cpu");
  EXPECT_EQ(w1["leases"], 0);
  EXPECT_GE(w1["published_unix_ms"].get<int64_t>(), before);
  EXPECT_LE(w1["published_unix_ms"].get<int64_t>(), after);
  EXPECT_GE(w1["age_seconds"].get<double>(), 0.0);

  // A lease taken shows; given back, it goes.
  tensorshm::StatusOr<DLManagedTensorVersioned*> held = client_->Acquire("models/w1");
  ASSERT_OK(held);
  CtlRun leased = Ctl({"ls", "models/", "-o", "json"});
  ASSERT_EQ(leased.exit_code, 0) << leased.err;
  const nlohmann::json under_prefix = leased.Json()["tensors"];
  EXPECT_EQ(under_prefix.size(), 2u) << leased.out;
  EXPECT_EQ(Find(under_prefix, "name", "models/w1")["leases"], 1) << leased.out;
  EXPECT_EQ(Find(under_prefix, "name", "models/w2")["leases"], 0) << leased.out;

  CtlRun text = Ctl({"ls"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  std::cout << text.out;
  EXPECT_TRUE(absl::StartsWith(text.out, "NAME       DTYPE  SHAPE      DEVICE  BYTES  LEASES  AGE"))
      << text.out;
  EXPECT_TRUE(absl::StartsWith(LineWith(text.out, "models/w1"),
                               "models/w1  int16  [4, 5]     cpu     40 B   1       "))
      << text.out;

  (*held)->deleter(*held);
  ASSERT_TRUE(client_->Flush().ok());
  CtlRun released = Ctl({"ls", "models/w1", "-o", "json"});
  ASSERT_EQ(released.exit_code, 0) << released.err;
  EXPECT_EQ(Find(released.Json()["tensors"], "name", "models/w1")["leases"], 0) << released.out;

  CtlRun none = Ctl({"ls", "nothing/"});
  EXPECT_EQ(none.exit_code, 0) << none.err;
  EXPECT_EQ(none.out, "no tensors published under \"nothing/\"\n");
}

TEST_F(CtlTest, InspectShowsEverythingKnownAboutOneTensor) {
  const int64_t before = absl::ToUnixMillis(absl::Now());
  Publish("col", {4, 5}, {1, 4});  // column-major
  Publish("flipped", {3, 5}, {-5, 1});
  Publish("col/longer", {1});  // "col" is a prefix of another name

  CtlRun json = Ctl({"inspect", "col", "-o", "json"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json col = json.Json();
  std::cout << json.out;
  EXPECT_EQ(col["name"], "col");
  EXPECT_GT(col["tensor_id"].get<uint64_t>(), 0u);
  EXPECT_EQ(col["dtype"], "int16");
  EXPECT_EQ(col["dtype_code"], kDLInt);
  EXPECT_EQ(col["dtype_bits"], 16);
  EXPECT_EQ(col["dtype_lanes"], 1);
  EXPECT_EQ(col["shape"], nlohmann::json({4, 5}));
  EXPECT_EQ(col["strides"], nlohmann::json({1, 4}));
  EXPECT_EQ(col["byte_offset"], 0);
  EXPECT_EQ(col["device"], "cpu");
  EXPECT_EQ(col["nbytes"], 40);
  EXPECT_EQ(col["flags"], 0);
  EXPECT_EQ(col["subbyte_padded"], false);
  EXPECT_EQ(col["leases"], 0);
  EXPECT_EQ(col["publisher_uid"], geteuid());
  EXPECT_EQ(col["publisher_pid"], getpid());
  EXPECT_GE(col["published_unix_ms"].get<int64_t>(), before);

  CtlRun flipped = Ctl({"inspect", "flipped", "-o", "json"});
  ASSERT_EQ(flipped.exit_code, 0) << flipped.err;
  EXPECT_EQ(flipped.Json()["strides"], nlohmann::json({-5, 1}));
  EXPECT_EQ(flipped.Json()["byte_offset"], 2 * 5 * 2);  // row 2 first, 2-byte elements

  CtlRun text = Ctl({"inspect", "col"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  std::cout << text.out;
  EXPECT_EQ(LineWith(text.out, "dtype:"), "dtype:        int16 (code 0, bits 16, lanes 1)");
  EXPECT_EQ(LineWith(text.out, "strides:"), "strides:      [1, 4] (elements)");
  EXPECT_EQ(LineWith(text.out, "publisher:"),
            absl::StrCat("publisher:    uid ", geteuid(), ", pid ", getpid()));

  CtlRun missing = Ctl({"inspect", "nope"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_TRUE(missing.out.empty()) << missing.out;
  EXPECT_TRUE(absl::StartsWith(missing.err, "tensorshmctl: inspect \"nope\": NOT_FOUND: "))
      << missing.err;
  std::cout << missing.err;
}

TEST_F(CtlTest, SessionsShowsAnotherProcessWithItsPidUidNameLeasesAndUnpublishedBytes) {
  Publish("shared", {4, 5});
  ChildProcess holder = StartPeer({"hold", "shared"});
  ASSERT_TRUE(holder.WaitForOutput("held", absl::Seconds(30))) << holder.Output();
  ChildProcess producer = StartPeer(
      {"produce", "late", "--dtype", "uint8", "--shape", "10000", "--hang-before-publish"});
  ASSERT_TRUE(producer.WaitForOutput("created", absl::Seconds(30))) << producer.Output();

  CtlRun json = Ctl({"sessions", "-o", "json"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  std::cout << json.out;
  const nlohmann::json sessions = json.Json()["sessions"];
  ASSERT_EQ(sessions.size(), 4u) << json.out;  // this test, holder, producer, tensorshmctl

  const nlohmann::json hold = Find(sessions, "pid", holder.pid());
  ASSERT_FALSE(hold.is_null()) << json.out;
  EXPECT_EQ(hold["uid"], geteuid());
  EXPECT_EQ(hold["gid"], getegid());
  EXPECT_EQ(hold["client_name"], "tsm_peer-hold");
  EXPECT_EQ(hold["client_version"], TENSORSHM_VERSION);
  EXPECT_EQ(hold["leases"], 1);
  EXPECT_EQ(hold["rpc_leases"].get<int64_t>() + hold["page_leases"].get<int64_t>(), 1);
  EXPECT_EQ(hold["unpublished_tensors"], 0);
  EXPECT_EQ(hold["own"], false);
  EXPECT_EQ(hold["redacted"], false);

  const nlohmann::json produce = Find(sessions, "pid", producer.pid());
  ASSERT_FALSE(produce.is_null()) << json.out;
  EXPECT_EQ(produce["client_name"], "tsm_peer-produce");
  EXPECT_EQ(produce["leases"], 0);
  // The created buffer (page-rounded), and any the daemon stocked for it ahead of need.
  EXPECT_GE(produce["unpublished_tensors"].get<int64_t>(), 1);
  EXPECT_GE(produce["unpublished_bytes"].get<int64_t>(), 10000);

  const nlohmann::json own = Find(sessions, "own", true);
  ASSERT_FALSE(own.is_null()) << json.out;
  EXPECT_EQ(own["client_name"], "tensorshmctl");

  CtlRun text = Ctl({"sessions"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  std::cout << text.out;
  EXPECT_TRUE(absl::StrContains(LineWith(text.out, "tsm_peer-hold"), "0.1.0")) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, "tensorshmctl (this command)")) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, absl::StrCat(" ", holder.pid(), " "))) << text.out;

  // A session that ended is gone from the list, and its lease with it.
  holder.Kill(SIGKILL);
  ASSERT_TRUE(holder.Wait(absl::Seconds(30)).ok());
  bool gone = false;
  for (int attempt = 0; attempt < 500 && !gone; ++attempt) {
    CtlRun after = Ctl({"sessions", "-o", "json"});
    gone = after.exit_code == 0 && Find(after.Json()["sessions"], "pid", holder.pid()).is_null();
    if (!gone) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(gone);
  CtlRun ls = Ctl({"ls", "shared", "-o", "json"});
  EXPECT_EQ(Find(ls.Json()["tensors"], "name", "shared")["leases"], 0) << ls.out;
}

TEST_F(CtlTest, RmDeletesTheNameAndASecondRmIsNotFound) {
  Publish("doomed", {8});
  Publish("kept", {8});
  CtlRun rm = Ctl({"rm", "doomed"});
  EXPECT_EQ(rm.exit_code, 0) << rm.err;
  EXPECT_EQ(rm.out, "deleted \"doomed\"\n");
  CtlRun ls = Ctl({"ls", "-o", "json"});
  const nlohmann::json tensors = ls.Json()["tensors"];
  EXPECT_TRUE(Find(tensors, "name", "doomed").is_null()) << ls.out;
  EXPECT_FALSE(Find(tensors, "name", "kept").is_null()) << ls.out;
  EXPECT_EQ(client_->Acquire("doomed").status().code(), tensorshm::StatusCode::kNotFound);

  CtlRun again = Ctl({"rm", "doomed"});
  EXPECT_EQ(again.exit_code, 1);
  std::cout << again.err;
  EXPECT_TRUE(absl::StartsWith(again.err, "tensorshmctl: rm \"doomed\": NOT_FOUND: ")) << again.err;

  CtlRun json = Ctl({"rm", "kept", "-o", "json"});
  EXPECT_EQ(json.exit_code, 0) << json.err;
  EXPECT_EQ(json.Json(), nlohmann::json({{"deleted", "kept"}}));
}

TEST_F(CtlTest, SocketComesFromTensorshmSocketLikeTheDaemons) {
  Publish("via-env", {2});
  CtlRun run =
      RunCtl(daemon_->dir(), {"ls", "-o", "json"}, {"TENSORSHM_SOCKET=" + daemon_->socket()});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_FALSE(Find(run.Json()["tensors"], "name", "via-env").is_null()) << run.out;
  // --socket wins over the environment.
  CtlRun flag = RunCtl(daemon_->dir(), {"--socket", daemon_->socket(), "ls", "-o", "json"},
                       {"TENSORSHM_SOCKET=/nonexistent/tensorshm.sock"});
  EXPECT_EQ(flag.exit_code, 0) << flag.err;
  // And without either, $XDG_RUNTIME_DIR/tensorshm.sock.
  CtlRun xdg = RunCtl(daemon_->dir(), {"ls"}, {"XDG_RUNTIME_DIR=" + daemon_->dir() + "/nothing"});
  EXPECT_EQ(xdg.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(xdg.err, daemon_->dir() + "/nothing/tensorshm.sock")) << xdg.err;
}

// ---- Bad usage: exit 2 and a message naming what is wrong ----

TEST(CtlUsageTest, UnknownSubcommandMissingNameAndBadOptionsExitTwo) {
  const std::string dir = ::testing::TempDir();
  CtlRun unknown = RunCtl(dir, {"frobnicate"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(unknown.err, "unknown subcommand \"frobnicate\"")) << unknown.err;
  std::cout << unknown.err;

  for (const char* verb : {"inspect", "rm"}) {
    CtlRun missing = RunCtl(dir, {verb});
    EXPECT_EQ(missing.exit_code, 2) << verb;
    EXPECT_TRUE(absl::StrContains(missing.err, "NAME is required")) << missing.err;
    EXPECT_TRUE(absl::StrContains(missing.err, absl::StrCat("tensorshmctl ", verb, " --help")))
        << missing.err;
    std::cout << missing.err;
  }
  CtlRun none = RunCtl(dir, {});
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(none.err, "subcommand is required")) << none.err;

  CtlRun format = RunCtl(dir, {"status", "-o", "yaml"});
  EXPECT_EQ(format.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(format.err, "yaml")) << format.err;
  CtlRun timeout = RunCtl(dir, {"--timeout", "soon", "status"});
  EXPECT_EQ(timeout.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(timeout.err, "--timeout = \"soon\"")) << timeout.err;
  CtlRun extra = RunCtl(dir, {"rm", "a", "b"});
  EXPECT_EQ(extra.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(extra.err, "b")) << extra.err;

  CtlRun bad_name = RunCtl(dir, {"inspect", "../etc"});
  EXPECT_EQ(bad_name.exit_code, 2);
  EXPECT_TRUE(absl::StartsWith(bad_name.err, "tensorshmctl: inspect: NAME ")) << bad_name.err;
  std::cout << bad_name.err;

  CtlRun help = RunCtl(dir, {"sessions", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(help.out, "docs/tensorshmctl.md")) << help.out;
}

// No subcommand needed: the one version of tensorshm (CMake's project VERSION).
TEST(CtlUsageTest, VersionNeedsNoSubcommand) {
  CtlRun version = RunCtl(::testing::TempDir(), {"--version"});
  EXPECT_EQ(version.exit_code, 0) << version.err;
  EXPECT_EQ(version.out, absl::StrCat("tensorshmctl ", TENSORSHM_VERSION, "\n"));
}

}  // namespace
}  // namespace tensorshm::testing
