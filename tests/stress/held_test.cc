// What held when issue 22's review attacked a daemon as another uid, kept as tests ("Held, and
// must keep holding"; the map from each item to its tests is tests/SECURITY_TESTS.md). Every test
// runs a real tensorshmd as root, and the attack as a real process of another uid started with
// setpriv: uid 65534, admitted with --allow-uid, or uid 12345, a stranger. The attacker,
// tsm_held_client, speaks the wire protocol itself. `ctest -R Held` runs them all.
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/raw_session.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

#define ASSERT_OK(x) ASSERT_TRUE((x).ok()) << (x).status()

// Sanitizer builds (kSanitized) run the load tests at a tenth of their counts (same shape).

constexpr int kAdmitted = 65534;
constexpr int kStranger = 12345;
constexpr char kSetpriv[] = "/usr/bin/setpriv";

// Why this process cannot run another uid's process, or "".
std::string CannotRunAsOthers() {
  if (geteuid() != 0) return "needs root to run processes as uids 65534 and 12345";
  if (access(kSetpriv, X_OK) != 0) return "needs /usr/bin/setpriv (util-linux)";
  return "";
}

#define SKIP_UNLESS_ROOT()                       \
  do {                                           \
    const std::string why = CannotRunAsOthers(); \
    if (!why.empty()) GTEST_SKIP() << why;       \
  } while (false)

// `argv` as it runs under setpriv as `uid` (gid the same, no supplementary groups).
std::vector<std::string> AsUid(int uid, std::vector<std::string> argv) {
  std::vector<std::string> wrapped = {kSetpriv,  "--reuid",           std::to_string(uid),
                                      "--regid", std::to_string(uid), "--clear-groups",
                                      "--"};
  wrapped.insert(wrapped.end(), argv.begin(), argv.end());
  return wrapped;
}

std::vector<std::string> Attacker(const std::string& mode, const std::string& socket,
                                  std::vector<std::string> args) {
  std::vector<std::string> argv = {TSM_HELD_CLIENT_PATH, mode, socket};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// Starts tsm_held_client `mode` as `uid`, its output logged in `dir`.
ChildProcess StartAs(int uid, const std::string& dir, const std::string& mode,
                     const std::string& socket, std::vector<std::string> args) {
  static int runs = 0;
  absl::StatusOr<ChildProcess> child =
      ChildProcess::Start(AsUid(uid, Attacker(mode, socket, std::move(args))),
                          absl::StrCat(dir, "/held-", mode, "-", uid, "-", ++runs, ".log"));
  TSM_CHECK(child.ok());
  return *std::move(child);
}

// Runs tsm_held_client to its end; its output, with "exit STATUS" appended unless it exited 0.
std::string RunAs(int uid, const TestDaemon& daemon, const std::string& mode,
                  std::vector<std::string> args, absl::Duration timeout = absl::Seconds(120)) {
  ChildProcess child = StartAs(uid, daemon.dir(), mode, daemon.socket(), std::move(args));
  absl::StatusOr<int> status = child.Wait(timeout);
  std::string output = child.Output();
  if (!status.ok() || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
    absl::StrAppend(&output, "exit ", status.ok() ? std::to_string(*status) : "timeout");
  }
  return output;
}

// A daemon that admits uid 65534 (a 0666 socket in a 0755 directory: anyone can connect, the
// daemon's admission decides).
absl::StatusOr<TestDaemon> StartShared(const std::string& name,
                                       std::vector<std::string> args = {}) {
  args.insert(args.end(), {"--allow-uid", std::to_string(kAdmitted), "--segment-size", "4Mi"});
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(name, args);
  if (daemon.ok()) chmod(daemon->dir().c_str(), 0755);
  return daemon;
}

// The value of the line "key: value" in `output` ("" if none).
std::string Field(const std::string& output, const std::string& key) {
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (absl::ConsumePrefix(&line, key + ": ")) return std::string(line);
  }
  return "";
}

// The canonical code of an answer line "code N message" (-1 if the line is not one).
int CodeOf(const std::string& value) {
  absl::string_view rest = value;
  if (!absl::ConsumePrefix(&rest, "code ")) return -1;
  int code = -1;
  if (!absl::SimpleAtoi(rest.substr(0, rest.find(' ')), &code)) return -1;
  return code;
}

// Publishes `bytes` bytes of `fill` as `name` through `client`; returns the tensor id.
uint64_t PublishFilled(Client& client, const std::string& name, int64_t bytes, uint8_t fill) {
  tensorshm::StatusOr<WritableTensor> w = client.Create({{kDLUInt, 8, 1}, {bytes}});
  TSM_CHECK(w.ok());
  std::memset(w->data(), fill, static_cast<size_t>(bytes));
  const uint64_t id = w->tensor_id();
  TSM_CHECK(client.Publish(*w, name).ok());
  return id;
}

// Whether `name` still holds `bytes` bytes of `fill`, read by `client`.
::testing::AssertionResult HoldsFill(Client& client, const std::string& name, int64_t bytes,
                                     uint8_t fill) {
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = client.Acquire(name);
  if (!t.ok()) return ::testing::AssertionFailure() << name << ": " << t.status();
  const DLTensor& dl = (*t)->dl_tensor;
  const auto* data = static_cast<const uint8_t*>(dl.data) + dl.byte_offset;
  const bool same = dl.ndim == 1 && dl.shape[0] == bytes &&
                    std::all_of(data, data + bytes, [fill](uint8_t b) { return b == fill; });
  (*t)->deleter(*t);
  if (!same) return ::testing::AssertionFailure() << name << " changed";
  return ::testing::AssertionSuccess();
}

// The tensor id `name` is bound to now (0 if none), as List says.
uint64_t BoundId(Client& client, const std::string& name) {
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = client.List(name);
  if (!listed.ok()) return 0;
  for (const TensorInfo& info : *listed) {
    if (info.name == name) return info.tensor_id;
  }
  return 0;
}

// Waits (bounded) until the daemon has `sessions` sessions open, as `own` sees them.
bool WaitForSessions(Client& own, int64_t sessions) {
  for (int i = 0; i < 1000; ++i) {
    tensorshm::StatusOr<ServerStats> stats = own.Stat();
    if (stats.ok() && stats->sessions == sessions) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

bool DaemonRuns(TestDaemon& daemon) {
  return kill(daemon.process().pid(), 0) == 0 && !daemon.process().Wait(absl::ZeroDuration()).ok();
}

// Every "<prefix> <attempt>: <result>" line of `output`, for the attempts that must fail.
void ExpectRefusedWrites(const std::string& output, const std::string& prefix) {
  for (const char* attempt : {"mmap rw", "mprotect", "reopen rw", "ftruncate shrink",
                              "ftruncate grow", "fallocate grow", "fallocate punch", "pwrite"}) {
    const std::string result = Field(output, absl::StrCat(prefix, " ", attempt));
    EXPECT_FALSE(result.empty()) << prefix << " " << attempt << " not tried: " << output;
    EXPECT_NE(result, "ok") << prefix << " " << attempt << " succeeded: " << output;
  }
  EXPECT_EQ(Field(output, prefix + " access"), "ro") << output;
}

// ---- Descriptors: segments, index and records, lease pages ----

// Item: writable descriptors of another uid's segments refused; read-only descriptors cannot be
// made writable (mmap PROT_WRITE MAP_SHARED, mprotect, /proc/self/fd reopen O_RDWR, ftruncate,
// fallocate, pwrite).
TEST(HeldDescriptorsTest, AnotherUidsSegmentIsNeverWritableByTheAdmittedUid) {
  SKIP_UNLESS_ROOT();
  absl::StatusOr<TestDaemon> daemon = StartShared("held-segment");
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  PublishFilled(**own, "owned", 1 << 20, 0x33);

  const std::string output = RunAs(kAdmitted, *daemon, "descriptors", {"owned"});
  std::cout << output;
  ASSERT_TRUE(absl::StrContains(output, "\ndone\n")) << output;
  EXPECT_EQ(CodeOf(Field(output, "acquire")), 0) << output;     // it may read it
  EXPECT_EQ(CodeOf(Field(output, "segment rw")), 7) << output;  // PERMISSION_DENIED
  EXPECT_TRUE(absl::StrContains(Field(output, "segment rw"), "writable")) << output;
  EXPECT_EQ(Field(output, "segment rw fd"), "none") << output;
  EXPECT_EQ(CodeOf(Field(output, "segment ro")), 0) << output;
  ExpectRefusedWrites(output, "segment");

  // Root's bytes and the segment are as they were; the daemon serves on.
  EXPECT_TRUE(HoldsFill(**own, "owned", 1 << 20, 0x33));
  tensorshm::StatusOr<WritableTensor> w = (*own)->Create({{kDLUInt, 8, 1}, {4096}});
  EXPECT_TRUE(w.ok()) << w.status();
}

// Item: the catalog index and the control segment's records are read-only for a client.
TEST(HeldDescriptorsTest, IndexAndRecordsAreReadOnlyForTheAdmittedUid) {
  SKIP_UNLESS_ROOT();
  absl::StatusOr<TestDaemon> daemon = StartShared("held-index");
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  PublishFilled(**own, "owned", 4096, 0x44);

  const std::string output = RunAs(kAdmitted, *daemon, "descriptors", {"owned"});
  std::cout << output;
  ASSERT_TRUE(absl::StrContains(output, "\ndone\n")) << output;
  EXPECT_EQ(CodeOf(Field(output, "index")), 0) << output;
  EXPECT_EQ(CodeOf(Field(output, "records")), 0) << output;
  ExpectRefusedWrites(output, "index");
  ExpectRefusedWrites(output, "records");

  // The fast path still finds root's tensor through the index, intact.
  EXPECT_TRUE(HoldsFill(**own, "owned", 4096, 0x44));
  PublishFilled(**own, "after", 4096, 0x45);
  EXPECT_TRUE(HoldsFill(**own, "after", 4096, 0x45));
}

// Item: a lease page is only ever its owner's, and sealed: the admitted uid's own page cannot be
// shrunk or grown (which would fault the daemon reading it), nor its seals changed; another
// process's page cannot be reached through /proc; and binding another's session is refused
// (HeldTokenTest below).
TEST(HeldDescriptorsTest, LeasePageIsItsOwnersOnlyAndSealed) {
  SKIP_UNLESS_ROOT();
  absl::StatusOr<TestDaemon> daemon = StartShared("held-lease");
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  PublishFilled(**own, "owned", 4096, 0x55);
  // Root's client leases through its own page, which this process holds a descriptor of.
  tensorshm::StatusOr<DLManagedTensorVersioned*> held = (*own)->Acquire("owned");
  ASSERT_OK(held);

  const std::string pids = absl::StrCat(getpid(), ",", daemon->process().pid());
  const std::string output =
      RunAs(kAdmitted, *daemon, "descriptors", {"owned", "--peer-pids", pids});
  std::cout << output;
  ASSERT_TRUE(absl::StrContains(output, "\ndone\n")) << output;
  EXPECT_EQ(CodeOf(Field(output, "lease")), 0) << output;
  EXPECT_EQ(Field(output, "lease seals"), "shrink grow seal") << output;
  EXPECT_NE(Field(output, "lease add seal"), "ok") << output;
  for (const char* attempt : {"ftruncate shrink", "ftruncate grow", "fallocate grow"}) {
    EXPECT_EQ(Field(output, absl::StrCat("lease ", attempt)), "EPERM") << attempt << ": " << output;
  }
  EXPECT_EQ(Field(output, "lease size"), "4096") << output;
  for (absl::string_view pid : absl::StrSplit(pids, ',')) {
    EXPECT_EQ(Field(output, absl::StrCat("proc ", pid)), "EACCES") << output;
    EXPECT_EQ(Field(output, absl::StrCat("proc ", pid, " fds opened")), "0") << output;
  }

  // The daemon reads every page (its housekeeping) and serves on; root's lease holds, and the
  // attacker's went with its session.
  ASSERT_TRUE(WaitForSessions(**own, 1));
  tensorshm::StatusOr<ServerStats> stats = (*own)->Stat();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->leases, 1);
  (*held)->deleter(*held);
  EXPECT_TRUE(HoldsFill(**own, "owned", 4096, 0x55));
}

// ---- Session tokens ----

// Item: binding the memory channel with another process's token is refused, for an admitted uid
// as for a stranger; no descriptor comes on that connection.
TEST(HeldTokenTest, BindingTheChannelWithAnotherProcesssTokenIsRefused) {
  SKIP_UNLESS_ROOT();
  absl::StatusOr<TestDaemon> daemon = StartShared("held-bind");
  ASSERT_OK(daemon);
  RawSession root(daemon->socket(), "root-raw");
  ASSERT_FALSE(root.token().empty());
  ASSERT_NE(root.Publish("owned"), 0u);

  for (int uid : {kAdmitted, kStranger}) {
    SCOPED_TRACE(absl::StrCat("uid ", uid));
    const std::string output = RunAs(uid, *daemon, "bind", {root.token()});
    std::cout << "uid " << uid << ":\n" << output;
    ASSERT_TRUE(absl::StrContains(output, "\ndone\n")) << output;
    const std::string bind = Field(output, "bind");
    // Refused (PERMISSION_DENIED), or the connection closed before it (a stranger's).
    EXPECT_TRUE(CodeOf(bind) == 7 || (uid == kStranger && bind == "closed")) << output;
    EXPECT_EQ(Field(output, "lease fd"), "none") << output;
    EXPECT_EQ(Field(output, "segment fd"), "none") << output;
    EXPECT_NE(CodeOf(Field(output, "lease")), 0) << output;
    EXPECT_NE(CodeOf(Field(output, "segment")), 0) << output;
  }
  // Root's session is untouched.
  v1::CreateResponse created;
  EXPECT_TRUE(root.Create(64, &created).ok());
}

// ---- Another uid's tensors and leases ----

// Item: another uid cannot delete, replace, publish or abandon root's tensors through its own
// session, or release root's leases: by RPC and on its own memory channel.
TEST(HeldTensorsTest, AdmittedUidCannotTouchRootsTensorsOrLeasesThroughItsOwnSession) {
  SKIP_UNLESS_ROOT();
  absl::StatusOr<TestDaemon> daemon = StartShared("held-tamper");
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  const uint64_t published = PublishFilled(**own, "owned", 4096, 0x66);
  // Root's unpublished tensor and RPC lease, on a raw session.
  RawSession root(daemon->socket(), "root-raw");
  v1::CreateResponse unpublished;
  ASSERT_TRUE(root.Create(128, &unpublished).ok());
  PendingAcquire lease(root, "owned", 0);
  ASSERT_TRUE(lease.Wait().ok());
  const uint64_t lease_id = lease.response().lease_id();
  ASSERT_NE(lease_id, 0u);

  const std::string output =
      RunAs(kAdmitted, *daemon, "tamper",
            {"owned", std::to_string(unpublished.tensor_id()), std::to_string(lease_id)});
  std::cout << output;
  ASSERT_TRUE(absl::StrContains(output, "\ndone\n")) << output;
  EXPECT_EQ(CodeOf(Field(output, "create")), 0) << output;  // its own buffers it may make
  EXPECT_EQ(CodeOf(Field(output, "channel bind")), 0) << output;
  for (const char* attempt :
       {"delete", "replace", "publish theirs", "publish theirs replace", "abandon theirs",
        "release their lease", "channel delete", "channel publish theirs", "channel replace"}) {
    const std::string result = Field(output, attempt);
    const int code = CodeOf(result);
    EXPECT_NE(code, -1) << attempt << " not tried: " << output;
    EXPECT_NE(code, 0) << attempt << " succeeded: " << output;
    // Refused as not its own (PERMISSION_DENIED), or as no tensor of its session
    // (FAILED_PRECONDITION, NOT_FOUND): never as a passing failure of the daemon.
    EXPECT_TRUE(code == 7 || code == 9 || code == 5) << attempt << ": " << result;
  }
  EXPECT_EQ(CodeOf(Field(output, "delete")), 7) << output;
  EXPECT_EQ(CodeOf(Field(output, "replace")), 7) << output;

  // Everything of root's is as it was: the name, its bytes, the lease, the unpublished buffer.
  EXPECT_EQ(BoundId(**own, "owned"), published);
  EXPECT_TRUE(HoldsFill(**own, "owned", 4096, 0x66));
  EXPECT_EQ(BoundId(**own, "owned-stolen"), 0u);
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = (*own)->List("owned");
  ASSERT_OK(listed);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ(listed->front().leases, 1);  // root's RPC lease
  v1::PublishRequest publish;
  publish.set_tensor_id(unpublished.tensor_id());
  publish.set_name("root-later");
  v1::PublishResponse answer;
  grpc::ClientContext context;
  root.Prepare(&context);
  EXPECT_TRUE(root.stub().Publish(&context, publish, &answer).ok());
}

// ---- Strangers ----

// Item: every TensorShm RPC and the memory channel are refused to a uid that is not admitted,
// with no session token and with an admitted process's token alike.
TEST(HeldStrangerTest, EveryRpcAndTheChannelAreRefusedToAStranger) {
  SKIP_UNLESS_ROOT();
  absl::StatusOr<TestDaemon> daemon = StartShared("held-stranger");
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  const uint64_t published = PublishFilled(**own, "owned", 4096, 0x77);
  RawSession root(daemon->socket(), "root-raw");
  ASSERT_FALSE(root.token().empty());
  tensorshm::StatusOr<ServerStats> before = (*own)->Stat();
  ASSERT_OK(before);

  const std::string output = RunAs(kStranger, *daemon, "stranger", {root.token(), "owned"});
  std::cout << output;
  ASSERT_TRUE(absl::StrContains(output, "\ndone\n")) << output;
  int answers = 0;
  for (const char* with : {"bare", "token"}) {
    for (const char* rpc : {"Create", "Publish", "Acquire", "Delete", "List", "Stat", "Sessions"}) {
      const std::string key = absl::StrCat(with, " ", rpc);
      const std::string result = Field(output, key);
      // PERMISSION_DENIED, or UNAVAILABLE where the connection is closed at accept.
      EXPECT_TRUE(CodeOf(result) == 7 || CodeOf(result) == 14) << key << ": " << result;
      if (CodeOf(result) == 7) ++answers;
    }
  }
  const std::string session = Field(output, "Session");
  EXPECT_TRUE(CodeOf(session) == 7 || CodeOf(session) == 14) << session;
  for (const char* call : {"channel bind", "channel lease", "channel segment", "channel create"}) {
    const std::string result = Field(output, call);
    EXPECT_TRUE(CodeOf(result) == 7 || result == "closed") << call << ": " << result;
  }
  EXPECT_FALSE(absl::StrContains(output, "channel fd received")) << output;
  std::cout << answers << " RPCs answered PERMISSION_DENIED, the rest UNAVAILABLE\n";

  // Nothing changed: root's tensor, names, sessions.
  EXPECT_EQ(BoundId(**own, "owned"), published);
  EXPECT_TRUE(HoldsFill(**own, "owned", 4096, 0x77));
  EXPECT_EQ(BoundId(**own, "owned-x"), 0u);
  tensorshm::StatusOr<ServerStats> after = (*own)->Stat();
  ASSERT_OK(after);
  EXPECT_EQ(after->sessions, before->sessions);
  EXPECT_EQ(after->names, before->names);
  EXPECT_EQ(after->tensors, before->tensors);
}

// ---- Malformed input ----

// Item: malformed shapes, strides, dtypes, devices and channel frames from an admitted uid are
// refused (INVALID_ARGUMENT naming the field; a bad frame closes its connection only).
TEST(HeldMalformedTest, MalformedRequestsOfAnAdmittedUidAreRefused) {
  SKIP_UNLESS_ROOT();
  absl::StatusOr<TestDaemon> daemon = StartShared("held-malformed");
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  PublishFilled(**own, "owned", 4096, 0x12);

  const std::string output = RunAs(kAdmitted, *daemon, "malformed", {});
  std::cout << output;
  ASSERT_TRUE(absl::StrContains(output, "\ndone\n")) << output;
  const std::map<std::string, std::string> fields = {
      {"shape", "shape"},     {"shape overflow", "overflow"},
      {"strides", "strides"}, {"dtype", "code"},
      {"lanes", "lanes"},     {"device", "type"},
      {"device id", "cpu:3"}};
  for (const auto& [label, word] : fields) {
    const std::string result = Field(output, label);
    EXPECT_EQ(CodeOf(result), 3) << label << ": " << result;  // INVALID_ARGUMENT
    EXPECT_TRUE(absl::StrContains(result, word)) << label << ": " << result;
  }
  EXPECT_EQ(Field(output, "frame garbage"), "closed") << output;
  EXPECT_EQ(Field(output, "frame huge"), "closed") << output;
  EXPECT_EQ(CodeOf(Field(output, "after")), 0) << output;
  EXPECT_TRUE(DaemonRuns(*daemon));
  EXPECT_TRUE(HoldsFill(**own, "owned", 4096, 0x12));
}

// ---- Load ----

// Item: random operations with lease-page scribbles cause no crash. Two processes of the
// admitted uid, four sessions each with its lease page mapped, run random creates, publishes,
// replaces, acquires, releases, abandons, deletes, lists, channel calls and session restarts,
// with random stores into their lease pages (ids of live tensors, ids not handed out yet,
// anything). The review ran ~280k; TSM_HELD_SCRIBBLE_OPS sets the operations per process (20,000
// by default, 2,000 in sanitizer builds).
TEST(HeldLoadTest, RandomOperationsWithLeasePageScribblesCauseNoCrash) {
  SKIP_UNLESS_ROOT();
  absl::StatusOr<TestDaemon> daemon = StartShared("held-scribble", {"--host-pool", "256Mi"});
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  const uint64_t published = PublishFilled(**own, "owned", 1 << 20, 0x5c);
  int64_t ops = kSanitized ? 2000 : 20000;
  if (const char* env = std::getenv("TSM_HELD_SCRIBBLE_OPS"); env != nullptr) {
    ASSERT_TRUE(absl::SimpleAtoi(env, &ops)) << env;
  }

  std::vector<ChildProcess> attackers;
  for (int i = 0; i < 2; ++i) {
    attackers.push_back(StartAs(
        kAdmitted, daemon->dir(), "scribble", daemon->socket(),
        {"--ops", std::to_string(ops), "--seed", std::to_string(2200 + i), "--sessions", "4"}));
  }
  std::map<std::string, int64_t> codes;
  for (ChildProcess& attacker : attackers) {
    absl::StatusOr<int> status = attacker.Wait(absl::Seconds(600));
    ASSERT_TRUE(status.ok()) << "still running: " << attacker.Output();
    const std::string output = attacker.Output();
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << output;
    EXPECT_TRUE(absl::StrContains(output, absl::StrCat("done ", ops))) << output;
    for (absl::string_view line : absl::StrSplit(output, '\n')) {
      if (absl::StartsWith(line, "unexpected ")) std::cout << line << "\n";
      std::vector<std::string> words = absl::StrSplit(line, ' ');
      int64_t n = 0;
      if (words.size() == 3 && words[0] == "code" && absl::SimpleAtoi(words[2], &n)) {
        codes[words[1]] += n;
      }
    }
  }
  std::string summary;
  for (const auto& [code, n] : codes) absl::StrAppend(&summary, " ", code, "=", n);
  std::cout << 2 * ops << " operations, by answer:" << summary << "\n";
  EXPECT_GT(codes["scribble"], 0);
  EXPECT_GT(codes["0"], 0);
  // No answer says the daemon failed (INTERNAL, UNKNOWN, DATA_LOSS) or went away (UNAVAILABLE),
  // and no channel connection was dropped. (The channel's create answers UNAVAILABLE when the pool
  // must grow first, for the client to use the RPC: not counted here.)
  for (const char* bad :
       {"2", "13", "14", "15", "channel-closed", "channel-2", "channel-13", "channel-15"}) {
    EXPECT_EQ(codes.count(bad), 0u) << bad << ":" << summary;
  }

  // The daemon runs, root's tensor is intact, and the attacker's sessions and leases are gone.
  EXPECT_TRUE(DaemonRuns(*daemon));
  EXPECT_EQ(BoundId(**own, "owned"), published);
  EXPECT_TRUE(HoldsFill(**own, "owned", 1 << 20, 0x5c));
  ASSERT_TRUE(WaitForSessions(**own, 1));
  tensorshm::StatusOr<ServerStats> stats = (*own)->Stat();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->leases, 0);
  PublishFilled(**own, "after", 4096, 0x5d);
  EXPECT_TRUE(HoldsFill(**own, "after", 4096, 0x5d));
}

// Item: 30,000 waiting acquires of the admitted uid (20 threads, a connection each) leave the
// owner's Stat fast. The review measured 0.30 ms; asserted: p50 under 25 ms (sanitizer builds:
// 3,000 waiters, 1,000 under TSan, under 100 ms).
TEST(HeldLoadTest, ThirtyThousandWaitingAcquiresLeaveTheOwnersStatFast) {
  SKIP_UNLESS_ROOT();
  // Under TSan a thirtieth: the daemon's exit tears down every cancelled call at once, and TSan
  // checks each race it sees in gRPC against its suppressions (once over a minute at 3,000).
  const int kWaiters = kThreadSanitized ? 1000 : kSanitized ? 3000 : 30000;
  absl::StatusOr<TestDaemon> daemon =
      StartShared("held-waiters", {"--uid-waiters", std::to_string(kWaiters)});
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "owner"});
  ASSERT_OK(own);
  PublishFilled(**own, "owned", 4096, 0x30);
  ChildProcess attacker =
      StartAs(kAdmitted, daemon->dir(), "waiters", daemon->socket(),
              {"never", "--count", std::to_string(kWaiters), "--threads", "20"});
  ASSERT_TRUE(attacker.WaitForOutput("waiting", absl::Seconds(240))) << attacker.Output();
  std::cout << attacker.Output();
  ASSERT_TRUE(absl::StartsWith(Line(attacker.Output(), "waiting"), absl::StrCat(kWaiters, " ")))
      << attacker.Output();

  std::vector<double> ms;
  for (int i = 0; i < 200; ++i) {
    const absl::Time start = absl::Now();
    ASSERT_OK((*own)->Stat());
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  std::sort(ms.begin(), ms.end());
  std::cout << "owner's Stat with " << kWaiters << " waiting: p50 " << ms[100] << " ms, p99 "
            << ms[198] << " ms, max " << ms.back() << " ms\n";
  EXPECT_LT(ms[100], kSanitized ? 100.0 : 25.0);
  // The owner works as usual meanwhile.
  PublishFilled(**own, "during", 4096, 0x31);
  EXPECT_TRUE(HoldsFill(**own, "during", 4096, 0x31));
  EXPECT_TRUE(HoldsFill(**own, "owned", 4096, 0x30));

  attacker.Kill(SIGKILL);
  ASSERT_TRUE(attacker.Wait(absl::Seconds(30)).ok());
  ASSERT_TRUE(WaitForSessions(**own, 1));
  EXPECT_TRUE(DaemonRuns(*daemon));
}

// ---- Paths another uid prepared ----

// Item: squatted, symlinked and planted socket paths and control objects are refused. Each is
// made by a process of uid 65534 (setpriv) in the world-writable sticky /tmp and /dev/shm, before
// root's daemon starts; the daemon refuses to start, naming the path, and leaves it in place.
class HeldPathsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = CannotRunAsOthers();
    if (!why.empty()) GTEST_SKIP() << why;
    struct stat st;
    ASSERT_EQ(stat("/tmp", &st), 0);
    if (st.st_uid != 0 || (st.st_mode & S_ISVTX) == 0 || (st.st_mode & 0002) == 0) {
      GTEST_SKIP() << "/tmp is not root's world-writable sticky directory";
    }
    base_ = absl::StrCat("/tmp/tsm-held-", getpid());
    prefix_ = absl::StrCat("tsmheld-", getpid());
    Clean();
    std::filesystem::create_directories(base_);
    chmod(base_.c_str(), 0755);
  }
  void TearDown() override {
    if (!base_.empty()) Clean();
  }
  void Clean() {
    std::error_code ignored;
    for (const std::string& path : made_) std::filesystem::remove_all(path, ignored);
    std::filesystem::remove_all(base_, ignored);
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ignored)) {
      if (absl::StartsWith(entry.path().filename().string(), prefix_ + ".")) {
        std::filesystem::remove(entry.path(), ignored);
      }
    }
  }
  // Runs `argv` as uid 65534; true if it exited 0.
  bool RunAsAdmitted(const std::vector<std::string>& argv) {
    absl::StatusOr<ChildProcess> child =
        ChildProcess::Start(AsUid(kAdmitted, argv), base_ + "/plant.log");
    if (!child.ok()) return false;
    absl::StatusOr<int> status = child->Wait(absl::Seconds(30));
    if (!status.ok() || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
      ADD_FAILURE() << absl::StrJoin(argv, " ") << ": " << child->Output();
      return false;
    }
    return true;
  }
  // Starts root's daemon on `socket`, which must refuse to start; its output.
  std::string RefusedDaemon(const std::string& socket) {
    absl::StatusOr<ChildProcess> daemon = ChildProcess::Start(
        {TensorShmdPath(), "--socket", socket, "--shm-prefix", prefix_, "--host-pool", "64Mi",
         "--segment-size", "16Mi", "--allow-uid", std::to_string(kAdmitted)},
        absl::StrCat(base_, "/daemon-", ++daemons_, ".log"));
    if (!daemon.ok()) return std::string(daemon.status().message());
    absl::StatusOr<int> status = daemon->Wait(absl::Seconds(20));
    std::string output = daemon->Output();
    EXPECT_TRUE(status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) != 0)
        << "the daemon did not refuse: " << output;
    return output;
  }
  // A path in /tmp for this test, removed at its end.
  std::string TmpPath(const std::string& tag) {
    made_.push_back(absl::StrCat(base_, "-", tag));
    return made_.back();
  }

  std::string base_;
  std::string prefix_;
  std::vector<std::string> made_;
  int daemons_ = 0;
};

TEST_F(HeldPathsTest, SocketDirectorySquattedByAnotherUidIsRefused) {
  const std::string squatted = TmpPath("squat");
  ASSERT_TRUE(RunAsAdmitted({"/bin/mkdir", "-m", "0777", squatted}));
  const std::string output = RefusedDaemon(squatted + "/tensorshm.sock");
  std::cout << "refused: " << output;
  EXPECT_TRUE(absl::StrContains(output, squatted)) << output;
  EXPECT_TRUE(absl::StrContains(output, "uid 65534")) << output;
  struct stat st;
  EXPECT_NE(lstat((squatted + "/tensorshm.sock").c_str(), &st), 0) << "a socket was bound there";
  ASSERT_EQ(lstat(squatted.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, static_cast<uid_t>(kAdmitted));
}

TEST_F(HeldPathsTest, SocketDirectoryThatIsAnotherUidsLinkIsRefused) {
  const std::string target = TmpPath("target");
  const std::string link = TmpPath("link");
  ASSERT_TRUE(RunAsAdmitted({"/bin/mkdir", "-m", "0700", target}));
  ASSERT_TRUE(RunAsAdmitted({"/bin/ln", "-s", target, link}));
  const std::string output = RefusedDaemon(link + "/tensorshm.sock");
  std::cout << "refused: " << output;
  EXPECT_TRUE(absl::StrContains(output, link)) << output;
  EXPECT_TRUE(absl::StrContains(output, "symbolic link")) << output;
  struct stat st;
  EXPECT_NE(lstat((target + "/tensorshm.sock").c_str(), &st), 0) << "the link was followed";
}

TEST_F(HeldPathsTest, SocketPlantedByAnotherUidIsRefusedAndLeftInPlace) {
  const std::string planted = TmpPath("planted.sock");
  ASSERT_TRUE(RunAsAdmitted({TSM_HELD_CLIENT_PATH, "plant-socket", planted}));
  struct stat st;
  ASSERT_EQ(lstat(planted.c_str(), &st), 0);
  ASSERT_TRUE(S_ISSOCK(st.st_mode));
  const std::string output = RefusedDaemon(planted);
  std::cout << "refused: " << output;
  EXPECT_TRUE(absl::StrContains(output, planted)) << output;
  EXPECT_TRUE(absl::StrContains(output, "uid 65534")) << output;
  ASSERT_EQ(lstat(planted.c_str(), &st), 0) << "the planted socket was removed";
  EXPECT_EQ(st.st_uid, static_cast<uid_t>(kAdmitted));

  // A plain file of that uid at the socket's path is refused the same way.
  const std::string file = TmpPath("file.sock");
  ASSERT_TRUE(RunAsAdmitted({"/usr/bin/truncate", "-s", "0", file}));
  const std::string file_output = RefusedDaemon(file);
  EXPECT_TRUE(absl::StrContains(file_output, file)) << file_output;
  EXPECT_EQ(lstat(file.c_str(), &st), 0) << "the planted file was removed";
}

TEST_F(HeldPathsTest, ControlObjectPlantedByAnotherUidIsRefusedAndLeftInPlace) {
  const std::string control = absl::StrCat("/dev/shm/", prefix_, ".ctl");
  ASSERT_TRUE(RunAsAdmitted({"/usr/bin/truncate", "-s", "1M", control}));
  const std::string output = RefusedDaemon(base_ + "/tensorshm.sock");
  std::cout << "refused: " << output;
  EXPECT_TRUE(absl::StrContains(output, control)) << output;
  EXPECT_TRUE(absl::StrContains(output, "uid 65534")) << output;
  struct stat st;
  ASSERT_EQ(lstat(control.c_str(), &st), 0) << "the planted object was removed";
  EXPECT_EQ(st.st_uid, static_cast<uid_t>(kAdmitted));
  EXPECT_EQ(st.st_size, 1 << 20);

  // A link under the control object's name, made by that uid, is not followed either.
  ASSERT_EQ(unlink(control.c_str()), 0);
  const std::string target = TmpPath("ctl-target");
  ASSERT_TRUE(RunAsAdmitted({"/usr/bin/truncate", "-s", "1M", target}));
  ASSERT_TRUE(RunAsAdmitted({"/bin/ln", "-s", target, control}));
  const std::string link_output = RefusedDaemon(base_ + "/tensorshm.sock");
  EXPECT_TRUE(absl::StrContains(link_output, control)) << link_output;
  ASSERT_EQ(lstat(control.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  ASSERT_EQ(stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 1 << 20);  // the link's target untouched
}

TEST_F(HeldPathsTest, PrefixLockFilePlantedByAnotherUidIsRefusedAndLeftInPlace) {
  const std::string lock = absl::StrCat("/dev/shm/", prefix_, ".lock");
  ASSERT_TRUE(RunAsAdmitted({"/usr/bin/truncate", "-s", "0", lock}));
  const std::string output = RefusedDaemon(base_ + "/tensorshm.sock");
  std::cout << "refused: " << output;
  EXPECT_TRUE(absl::StrContains(output, lock)) << output;
  EXPECT_TRUE(absl::StrContains(output, "uid 65534")) << output;
  struct stat st;
  ASSERT_EQ(lstat(lock.c_str(), &st), 0) << "the planted lock file was removed";
  EXPECT_EQ(st.st_uid, static_cast<uid_t>(kAdmitted));
  EXPECT_NE(lstat(absl::StrCat("/dev/shm/", prefix_, ".ctl").c_str(), &st), 0);
}

}  // namespace
}  // namespace tensorshm::testing
