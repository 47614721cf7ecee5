// Tensor records counted per uid (--uid-tensors, issue 22 finding 4) on a real daemon, with a
// second uid (65534, admitted with --allow-uid) publishing through tsm_uid_tensors_client run
// with setpriv: empty tensors of one uid no longer take the catalog's records from another, and
// --evict lru never evicts another uid's tensors to make room for a uid past its share.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr int kOther = 65534;

#define ASSERT_OK(expr) ASSERT_TRUE((expr).ok()) << (expr).status()

absl::StatusOr<TestDaemon> StartShared(const std::string& name, std::vector<std::string> args) {
  // Info: the eviction lines.
  args.insert(args.end(), {"--allow-uid", std::to_string(kOther), "--log-level", "info"});
  absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(name, args);
  // The other uid must reach the socket in the daemon's directory.
  if (daemon.ok()) chmod(daemon->dir().c_str(), 0755);
  return daemon;
}

// Runs tsm_uid_tensors_client `mode` `args` (after the socket) as uid 65534 to its end; returns
// its output, with "exit N" appended unless it exited 0.
std::string RunOther(const TestDaemon& daemon, const std::string& mode,
                     const std::vector<std::string>& args) {
  static int runs = 0;
  std::vector<std::string> argv = AsUid(kOther);
  argv.insert(argv.end(), {TSM_UID_TENSORS_CLIENT_PATH, mode, daemon.socket()});
  argv.insert(argv.end(), args.begin(), args.end());
  return RunToEnd(argv, absl::StrCat(daemon.dir(), "/uid-tensors-", mode, "-", ++runs, ".log"));
}

// The number after `key` in `output`, or -1.
int64_t Number(const std::string& output, const std::string& key) {
  int64_t value = -1;
  if (!absl::SimpleAtoi(Line(output, key), &value)) return -1;
  return value;
}

// The byte at `i` of the daemon's uid's tensor number `k` (as tsm_uid_tensors_client fills its).
uint8_t Pattern(int64_t k, int64_t i) { return static_cast<uint8_t>((k * 7 + i) % 253); }

// Creates and publishes `name` of `bytes` bytes, filled with Pattern(k, .).
tensorshm::Status Put(Client& client, const std::string& name, int64_t k, int64_t bytes) {
  tensorshm::StatusOr<WritableTensor> tensor = client.Create(TensorSpec{{kDLUInt, 8, 1}, {bytes}});
  if (!tensor.ok()) return tensor.status();
  auto* data = static_cast<uint8_t*>(tensor->data());
  for (int64_t i = 0; i < bytes; ++i) data[i] = Pattern(k, i);
  return client.Publish(*tensor, name);
}

// Acquires `name` and checks every byte against Pattern(k, .).
tensorshm::Status Check(Client& client, const std::string& name, int64_t k) {
  tensorshm::StatusOr<DLManagedTensorVersioned*> held = client.Acquire(name);
  if (!held.ok()) return held.status();
  const DLTensor& t = (*held)->dl_tensor;
  const auto* data = static_cast<const uint8_t*>(t.data) + t.byte_offset;
  tensorshm::Status status;
  for (int64_t i = 0; i < t.shape[0] && status.ok(); ++i) {
    if (data[i] != Pattern(k, i)) {
      status = tensorshm::Status(tensorshm::StatusCode::kDataLoss,
                                 absl::StrCat(name, ": byte ", i, " differs"));
    }
  }
  (*held)->deleter(*held);
  return status;
}

// Lines of the daemon's log that say it evicted something.
std::vector<std::string> Evictions(TestDaemon& daemon) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(daemon.process().Output(), '\n')) {
    if (absl::StrContains(line, "evicted \"")) lines.emplace_back(line);
  }
  return lines;
}

// The daemon's uid puts five 4 KiB tensors "root.0" .. "root.4".
std::shared_ptr<Client> OwnerWithFive(const TestDaemon& daemon) {
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon.socket(), "uid-tensors-owner"});
  TSM_CHECK(own.ok());
  for (int k = 0; k < 5; ++k) TSM_CHECK(Put(**own, absl::StrCat("root.", k), k, 4096).ok());
  return *own;
}

void ExpectOwnersFiveIntact(Client& own) {
  for (int k = 0; k < 5; ++k) {
    EXPECT_TRUE(Check(own, absl::StrCat("root.", k), k).ok()) << "root." << k;
  }
}

// The attack: --max-tensors 256 --uid-quota 1Mi, the daemon's uid holds five tensors,
// and uid 65534 publishes 251 empty ones (no quota counts them). It is refused at its share, 128
// records, naming the flag; its tensors outlive its session, and the daemon's uid still creates
// its own 128.
TEST(UidTensorsTest, EmptyTensorsOfOneUidDoNotBlockAnotherUidsCreates) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534 (setpriv)";
  absl::StatusOr<TestDaemon> daemon =
      StartShared("uid-tensors", {"--max-tensors", "256", "--uid-quota", "1Mi"});
  ASSERT_OK(daemon);
  std::shared_ptr<Client> own = OwnerWithFive(*daemon);

  const std::string output = RunOther(*daemon, "put", {"z", "251", "0"});
  std::cout << "uid 65534, 251 empty tensors: " << output;
  EXPECT_EQ(Number(output, "put"), 128) << output;
  EXPECT_TRUE(absl::StrContains(
      output,
      "refused 8 uid 65534: 128 tensor records held (published tensors, empty ones included, and "
      "unpublished creates), limit 128 (--uid-tensors)"))
      << output;
  // Its session ended; its tensors did not, and they still count.
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = own->List("z.");
  ASSERT_OK(listed);
  EXPECT_EQ(listed->size(), 128u);
  const std::string again = RunOther(*daemon, "put", {"y", "1", "0"});
  EXPECT_EQ(Number(again, "put"), 0) << again;
  EXPECT_TRUE(absl::StrContains(again, "(--uid-tensors)")) << again;

  // The daemon's uid creates its own 128 (it holds 5): every create succeeds.
  int64_t created = 0;
  tensorshm::Status refused;
  for (int k = 5; k < 200 && refused.ok(); ++k) {
    refused = Put(*own, absl::StrCat("root.", k), k, 0);
    if (refused.ok()) ++created;
  }
  std::cout << "uid 0 then created " << created << " more; then: " << refused << "\n";
  EXPECT_EQ(created, 123);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "uid 0: 128 tensor records held")) << refused;
  ExpectOwnersFiveIntact(*own);

  // A delete gives the room back at once.
  ASSERT_TRUE(own->Delete("root.5").ok());
  EXPECT_TRUE(Put(*own, "root.again", 0, 0).ok());
}

// Whoever comes first: uid 65534 fills its share before the daemon's uid has created anything,
// and the daemon's uid still gets its whole share.
TEST(UidTensorsTest, AUidThatComesFirstTakesOnlyItsShare) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534 (setpriv)";
  absl::StatusOr<TestDaemon> daemon = StartShared("uid-tensors-first", {"--max-tensors", "256"});
  ASSERT_OK(daemon);
  const std::string output = RunOther(*daemon, "put", {"z", "251", "0"});
  EXPECT_EQ(Number(output, "put"), 128) << output;
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "uid-tensors-owner"});
  ASSERT_OK(own);
  for (int k = 0; k < 128; ++k) {
    ASSERT_TRUE(Put(**own, absl::StrCat("root.", k), k, 0).ok()) << k;
  }
  const tensorshm::Status past = Put(**own, "root.past", 0, 0);
  EXPECT_TRUE(absl::StrContains(past.message(), "limit 128 (--uid-tensors)")) << past;
}

// The attack with --evict lru, which evicted all five of the daemon's uid's tensors:
// now uid 65534, at its share of records, evicts its own oldest tensors to make room (all 251
// creates succeed, it holds 128), and none of the daemon's uid's.
TEST(UidTensorsTest, WithEvictLruAUidAtItsShareEvictsOnlyItsOwnTensors) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534 (setpriv)";
  absl::StatusOr<TestDaemon> daemon = StartShared(
      "uid-tensors-lru", {"--max-tensors", "256", "--uid-quota", "1Mi", "--evict", "lru"});
  ASSERT_OK(daemon);
  std::shared_ptr<Client> own = OwnerWithFive(*daemon);

  const std::string output = RunOther(*daemon, "put", {"z", "251", "0"});
  std::cout << "uid 65534, 251 empty tensors with --evict lru: " << output;
  EXPECT_EQ(Number(output, "put"), 251) << output;
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = own->List("z.");
  ASSERT_OK(listed);
  EXPECT_EQ(listed->size(), 128u);
  ASSERT_FALSE(listed->empty());
  EXPECT_EQ(listed->front().name, "z.123");  // z.0 .. z.122, the oldest, went
  ExpectOwnersFiveIntact(*own);
  const std::vector<std::string> evictions = Evictions(*daemon);
  EXPECT_EQ(evictions.size(), 123u);
  for (const std::string& line : evictions) {
    EXPECT_TRUE(absl::StrContains(line, " of uid 65534, 0 bytes")) << line;
    EXPECT_TRUE(absl::StrContains(line,
                                  "a create by uid 65534 (it holds 128 tensor records, its "
                                  "limit, --uid-tensors; --evict lru)"))
        << line;
  }
  if (!evictions.empty()) std::cout << "first eviction: " << evictions.front() << "\n";

  // The daemon's uid still has its share.
  for (int k = 5; k < 128; ++k) {
    ASSERT_TRUE(Put(*own, absl::StrCat("root.", k), k, 0).ok()) << k;
  }
  EXPECT_EQ(Evictions(*daemon).size(), 123u);
}

// With no per-uid limit (--uid-tensors 0) uid 65534 can fill the record table. Once it is full,
// a create evicts the creating uid's own tensors first; uid 65534, past its share (half of the
// records), evicts only its own, and the daemon's uid, within its share, evicts its own and then
// uid 65534's, never the other way round.
TEST(UidTensorsTest, AFullRecordTableEvictsOwnTensorsFirstThenAUidsPastItsShare) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534 (setpriv)";
  absl::StatusOr<TestDaemon> daemon = StartShared(
      "uid-tensors-table", {"--max-tensors", "256", "--uid-tensors", "0", "--evict", "lru"});
  ASSERT_OK(daemon);
  std::shared_ptr<Client> own = OwnerWithFive(*daemon);
  // The five are held (not evictable); "root.own" is not.
  std::vector<DLManagedTensorVersioned*> held;
  for (int k = 0; k < 5; ++k) {
    tensorshm::StatusOr<DLManagedTensorVersioned*> lease = own->Acquire(absl::StrCat("root.", k));
    ASSERT_OK(lease);
    held.push_back(*lease);
  }
  ASSERT_TRUE(Put(*own, "root.own", 9, 4096).ok());

  const std::string output = RunOther(*daemon, "put", {"z", "260", "0"});
  EXPECT_EQ(Number(output, "put"), 260) << output;
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = own->List("z.");
  ASSERT_OK(listed);
  EXPECT_EQ(listed->size(), 250u);  // the table is full: ten of its own went for its last ten
  std::vector<std::string> evictions = Evictions(*daemon);
  EXPECT_EQ(evictions.size(), 10u);
  for (const std::string& line : evictions) {
    EXPECT_TRUE(absl::StrContains(line, " of uid 65534, ")) << line;
    EXPECT_TRUE(absl::StrContains(line, " by uid 65534 (all 256 tensor records in use")) << line;
  }

  // The daemon's uid creates 20 (kept unpublished): its own unheld tensor goes first, then
  // uid 65534's.
  std::vector<WritableTensor> kept;
  for (int k = 0; k < 20; ++k) {
    tensorshm::StatusOr<WritableTensor> tensor = own->Create(TensorSpec{{kDLUInt, 8, 1}, {4096}});
    ASSERT_OK(tensor);
    kept.push_back(*std::move(tensor));
  }
  evictions = Evictions(*daemon);
  ASSERT_EQ(evictions.size(), 30u);
  EXPECT_TRUE(absl::StrContains(evictions[10], "evicted \"root.own\"")) << evictions[10];
  EXPECT_TRUE(absl::StrContains(evictions[10], " by uid 0 ")) << evictions[10];
  for (size_t i = 11; i < evictions.size(); ++i) {
    EXPECT_TRUE(absl::StrContains(evictions[i], " of uid 65534, ")) << evictions[i];
    EXPECT_TRUE(absl::StrContains(evictions[i], " by uid 0 ")) << evictions[i];
  }
  std::cout << "own first: " << evictions[10] << "\nthen: " << evictions.back() << "\n";
  for (DLManagedTensorVersioned* lease : held) lease->deleter(lease);
  ExpectOwnersFiveIntact(*own);
}

// Bytes: uid 65534 publishes far past its share of the host pool with --evict lru. Its creates
// evict its own oldest tensors; the daemon's uid's tensors stay, byte for byte.
TEST(UidTensorsTest, CreatingPastItsShareOfThePoolEvictsItsOwnTensorsFirst) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 65534 (setpriv)";
  absl::StatusOr<TestDaemon> daemon = StartShared(
      "uid-tensors-bytes", {"--host-pool", "16Mi", "--segment-size", "4Mi", "--evict", "lru"});
  ASSERT_OK(daemon);
  tensorshm::StatusOr<std::shared_ptr<Client>> own =
      Client::Connect(ClientOptions{daemon->socket(), "uid-tensors-owner"});
  ASSERT_OK(own);
  constexpr int64_t kMiB = 1 << 20;
  for (int k = 0; k < 4; ++k) ASSERT_TRUE(Put(**own, absl::StrCat("big.", k), k, kMiB).ok());

  const std::string output = RunOther(*daemon, "put", {"z", "40", std::to_string(kMiB)});
  std::cout << "uid 65534, 40 MiB in 1 MiB tensors with --evict lru: " << output;
  EXPECT_EQ(Number(output, "put"), 40) << output;
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(Check(**own, absl::StrCat("big.", k), k).ok()) << "big." << k;
  }
  const std::vector<std::string> evictions = Evictions(*daemon);
  EXPECT_GE(evictions.size(), 32u);  // it holds at most its half of the pool, 8 of the 40
  for (const std::string& line : evictions) {
    EXPECT_TRUE(absl::StrContains(line, "evicted \"z.")) << line;
    EXPECT_TRUE(absl::StrContains(line, " of uid 65534, ")) << line;
  }
  if (!evictions.empty()) std::cout << "first eviction: " << evictions.front() << "\n";
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = (*own)->List("z.");
  ASSERT_OK(listed);
  EXPECT_EQ(listed->size() + evictions.size(), 40u);
  EXPECT_TRUE(absl::StrContains(RunOther(*daemon, "count", {"z."}), "listed ")) << "count";
}

}  // namespace
}  // namespace tensorshm::testing
