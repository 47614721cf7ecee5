// Tensor records counted per uid (--uid-tensors): the flag and its default share, and the
// catalog's count, limit and eviction order (the real-daemon tests are uid_tensors_test.cc).
#include <stdlib.h>
#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>
#include <cstdio>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_driver.h"
#include "gtest/gtest.h"
#include "server/catalog/catalog.h"
#include "server/ops/options.h"
#include "server/ops/uid_limits.h"
#include "tests/support/test_daemon.h"

namespace tensorshm {
namespace {

absl::StatusOr<DaemonOptions> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "tensorshmd");
  return ParseOptions(static_cast<int>(args.size()), const_cast<char**>(args.data()));
}

TEST(UidTensorsOptionsTest, TheDefaultIsAnEvenShareOfTheCatalogBetweenTheAdmittedUids) {
  absl::StatusOr<DaemonOptions> alone = Parse({});
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->uid_limits.tensors, 4096u);  // the daemon's uid alone: the whole catalog
  const std::string other = std::to_string(geteuid() == 65534 ? 65533 : 65534);
  absl::StatusOr<DaemonOptions> two = Parse({"--allow-uid", other.c_str()});
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->uid_limits.tensors, 2048u);
  // The daemon's own uid listed again is not another uid; each --allow-gid counts as one.
  const std::string self = std::to_string(geteuid());
  absl::StatusOr<DaemonOptions> four =
      Parse({"--max-tensors", "256", "--allow-uid", self.c_str(), "--allow-uid", other.c_str(),
             "--allow-gid", "5", "--allow-gid", "6"});
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(four->uid_limits.tensors, 64u);
  EXPECT_EQ(FairTensorShare(3, 0, {1, 2, 3, 4}, 0), 1u);  // never 0, which would mean no limit
  EXPECT_TRUE(absl::StrContains(Usage(), "--uid-tensors N"));
}

TEST(UidTensorsOptionsTest, TheFlagSetsTheLimitAndBadValuesNameIt) {
  absl::StatusOr<DaemonOptions> set = Parse({"--uid-tensors", "100", "--allow-uid", "65534"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->uid_limits.tensors, 100u);
  absl::StatusOr<DaemonOptions> off = Parse({"--uid-tensors=0", "--allow-uid", "65534"});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->uid_limits.tensors, 0u);  // no limit
  for (const char* bad : {"-1", "", "x", "1.5", "99999999999999999999999"}) {
    absl::StatusOr<DaemonOptions> options = Parse({"--uid-tensors", bad});
    ASSERT_FALSE(options.ok()) << bad;
    EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(options.status().message(),
                                 absl::StrCat("--uid-tensors = \"", bad, "\": expected a whole")))
        << options.status();
  }
}

TEST(UidTensorsOptionsTest, AConfigFileKeySetsIt) {
  const std::string path = absl::StrCat("/tmp/tsmtest-uid-tensors-", getpid(), ".toml");
  {
    std::ofstream file(path);
    file << "uid-tensors = 64\nallow-uid = [65534]\n";
  }
  absl::StatusOr<DaemonOptions> options = Parse({"--config", path.c_str()});
  std::remove(path.c_str());
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->uid_limits.tensors, 64u);
}

constexpr uint32_t kOwner = 0;
constexpr uint32_t kOther = 65534;
const DLDataType kU8{kDLUInt, 8, 1};
const DLDevice kCpu{kDLCPU, 0};

class UidTensorsCatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = absl::StrCat("tsmtest-uidtensors-", getpid());
    for (const char* suffix : {".ctl", ".cpu.1", ".cpu.2", ".cpu.3"}) {
      boost::interprocess::shared_memory_object::remove((prefix_ + suffix).c_str());
    }
    absl::StatusOr<std::unique_ptr<Catalog>> catalog =
        Catalog::Create(CatalogOptions{prefix_, 16 << 20, 4 << 20, 8});
    ASSERT_TRUE(catalog.ok()) << catalog.status();
    catalog_ = *std::move(catalog);
  }

  // Creates an empty tensor of `uid` (session `uid + 1`; with `evict` as --evict lru does) and
  // publishes it as `name` unless empty.
  absl::StatusOr<uint64_t> Put(uint32_t uid, const std::string& name, bool evict = false) {
    const int64_t zero = 0;
    const absl::Span<const int64_t> shape = absl::MakeConstSpan(&zero, 1);
    absl::StatusOr<const Tensor*> tensor =
        evict ? catalog_->CreateEvicting(uid + 1, kU8, shape, {}, kCpu, false, uid, nullptr)
              : catalog_->Create(uid + 1, kU8, shape, {}, kCpu, false, uid, nullptr);
    if (!tensor.ok()) return tensor.status();
    const uint64_t id = (*tensor)->id;
    if (!name.empty()) {
      if (absl::Status s = catalog_->Publish(uid + 1, id, name, false); !s.ok()) return s;
    }
    return id;
  }

  std::string prefix_;
  std::unique_ptr<Catalog> catalog_;
};

TEST_F(UidTensorsCatalogTest, RecordsAreCountedPerUidUntilFreed) {
  catalog_->set_uid_tensors(3);
  ASSERT_TRUE(Put(kOther, "z.0").ok());
  ASSERT_TRUE(Put(kOther, "z.1").ok());
  ASSERT_TRUE(Put(kOther, "").ok());  // unpublished creates count too
  EXPECT_EQ(catalog_->RecordsOf(kOther), 3u);
  absl::StatusOr<uint64_t> refused = Put(kOther, "z.2");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.status().message(),
            "uid 65534: 3 tensor records held (published tensors, empty ones included, and "
            "unpublished creates), limit 3 (--uid-tensors); delete some of this uid's tensors "
            "first");
  EXPECT_EQ(catalog_->RoomForRecord(kOther, false).code(), absl::StatusCode::kResourceExhausted);
  // Another uid has its own count.
  ASSERT_TRUE(Put(kOwner, "root.0").ok());
  EXPECT_EQ(catalog_->RecordsOf(kOwner), 1u);
  EXPECT_TRUE(catalog_->RoomForRecord(kOwner, false).ok());
  // A delete gives the record back.
  ASSERT_TRUE(catalog_->Delete("z.0").ok());
  EXPECT_EQ(catalog_->RecordsOf(kOther), 2u);
  EXPECT_TRUE(Put(kOther, "z.3").ok());
}

// A single-user daemon's default, the whole catalog, is no limit: a full table is a full
// table (--max-tensors, which a create may wait for), as before.
TEST_F(UidTensorsCatalogTest, ALimitOfTheWholeCatalogIsNone) {
  catalog_->set_uid_tensors(8);
  EXPECT_EQ(catalog_->uid_tensors(), 0u);
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(Put(kOwner, "").ok());
  EXPECT_TRUE(catalog_->RoomForRecord(kOwner, false).ok());
  absl::StatusOr<uint64_t> full = Put(kOwner, "");
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(full.status().message(), "(--max-tensors)")) << full.status();
}

TEST_F(UidTensorsCatalogTest, AUidAtItsLimitEvictsOnlyItsOwnTensors) {
  catalog_->set_uid_tensors(3);
  ASSERT_TRUE(Put(kOwner, "root.0").ok());  // the oldest of all
  for (const char* name : {"z.0", "z.1", "z.2"}) ASSERT_TRUE(Put(kOther, name).ok());
  EXPECT_TRUE(catalog_->RoomForRecord(kOther, /*evict=*/true).ok());
  EXPECT_EQ(catalog_->Find("z.0"), nullptr);  // its own least recently used
  EXPECT_NE(catalog_->Find("root.0"), nullptr);
  EXPECT_EQ(catalog_->evicted_tensors(), 1);
  EXPECT_EQ(catalog_->RecordsOf(kOther), 2u);
  // With nothing of its own to evict (unpublished creates are never evicted), it is refused.
  ASSERT_TRUE(catalog_->Delete("z.1").ok());
  ASSERT_TRUE(catalog_->Delete("z.2").ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Put(kOther, "").ok());
  EXPECT_EQ(catalog_->RoomForRecord(kOther, true).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(catalog_->Find("root.0"), nullptr);
}

TEST_F(UidTensorsCatalogTest, AFullTableEvictsOwnFirstThenAUidPastItsShare) {
  catalog_->set_uid_tensors(0);  // no limit: the table (8) can fill
  ASSERT_TRUE(Put(kOwner, "root.0").ok());
  ASSERT_TRUE(Put(kOwner, "").ok());  // not evictable
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(Put(kOther, absl::StrCat("z.", i)).ok());
  // uid 65534 is past its share (8 / 2 = 4): only its own go.
  ASSERT_TRUE(Put(kOther, "z.6", true).ok());
  EXPECT_EQ(catalog_->Find("z.0"), nullptr);
  EXPECT_NE(catalog_->Find("root.0"), nullptr);
  // The daemon's uid, within its share: its own first ...
  ASSERT_TRUE(Put(kOwner, "", true).ok());
  EXPECT_EQ(catalog_->Find("root.0"), nullptr);
  EXPECT_NE(catalog_->Find("z.1"), nullptr);
  // ... then the tensors of the uid past its share.
  ASSERT_TRUE(Put(kOwner, "", true).ok());
  EXPECT_EQ(catalog_->Find("z.1"), nullptr);
  EXPECT_EQ(catalog_->RecordsOf(kOwner), 3u);
  EXPECT_EQ(catalog_->RecordsOf(kOther), 5u);
  EXPECT_EQ(catalog_->evicted_tensors(), 3);
  // Down to its share, uid 65534 no longer loses records to the daemon's uid.
  ASSERT_TRUE(Put(kOwner, "", true).ok());
  EXPECT_EQ(catalog_->RecordsOf(kOther), 4u);
  absl::StatusOr<uint64_t> refused = Put(kOwner, "", true);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(catalog_->RecordsOf(kOther), 4u);
}

// A full CUDA pool (shared by every uid, unlike the host pool's per-uid segments), on the
// emulated driver: a uid past its share of the pool's bytes evicts only its own tensors; one
// within its share takes from a uid past its own once none of its own is evictable.
TEST_F(UidTensorsCatalogTest, AFullCudaPoolEvictsFromTheUidPastItsShareOfBytes) {
  setenv("TENSORSHM_LIBCUDA", testing::FakeCudaPath().c_str(), 1);
  setenv("TSM_FAKE_CUDA_DEVICES", "1", 1);
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  ASSERT_TRUE(driver.ok()) << driver.status();
  constexpr int64_t kMiB = 1 << 20;
  absl::StatusOr<std::unique_ptr<CudaPool>> pool =
      CudaPool::Create(*driver, CudaPoolOptions{0, CudaPoolKind::kAuto, 4 * kMiB, 4 * kMiB});
  ASSERT_TRUE(pool.ok()) << pool.status();
  catalog_->AddCudaPool(*std::move(pool));
  const DLDevice cuda{kDLCUDA, 0};
  auto put = [&](uint32_t uid, const std::string& name) -> absl::StatusOr<uint64_t> {
    absl::StatusOr<const Tensor*> tensor = catalog_->CreateEvicting(
        uid + 1, kU8, absl::MakeConstSpan(&kMiB, 1), {}, cuda, false, uid, nullptr);
    if (!tensor.ok()) return tensor.status();
    const uint64_t id = (*tensor)->id;
    if (absl::Status s = catalog_->Publish(uid + 1, id, name, false); !s.ok()) return s;
    return id;
  };
  absl::StatusOr<uint64_t> root = put(kOwner, "root.0");  // the least recently used of all
  ASSERT_TRUE(root.ok()) << root.status();
  for (const char* name : {"z.0", "z.1", "z.2"}) ASSERT_TRUE(put(kOther, name).ok()) << name;
  // Full. uid 65534 holds 3 MiB, past its share (2 MiB): only its own go.
  ASSERT_TRUE(put(kOther, "z.3").ok());
  EXPECT_EQ(catalog_->Find("z.0"), nullptr);
  EXPECT_NE(catalog_->Find("root.0"), nullptr);
  // The daemon's uid (1 MiB), within its share, holds root.0 leased: nothing of its own to
  // evict, so uid 65534's least recently used goes.
  catalog_->AddLease(*root);
  ASSERT_TRUE(put(kOwner, "root.1").ok());
  EXPECT_EQ(catalog_->Find("z.1"), nullptr);
  EXPECT_NE(catalog_->Find("root.0"), nullptr);
  // Now 2 MiB each: neither is past its share, so each create evicts only its creator's own.
  catalog_->DropLease(*root);
  ASSERT_TRUE(put(kOther, "z.4").ok());
  EXPECT_EQ(catalog_->Find("z.2"), nullptr);
  EXPECT_NE(catalog_->Find("root.0"), nullptr);
  ASSERT_TRUE(put(kOwner, "root.2").ok());
  EXPECT_EQ(catalog_->Find("root.0"), nullptr);
  EXPECT_NE(catalog_->Find("z.3"), nullptr);
  EXPECT_EQ(catalog_->evicted_tensors(), 4);
}

}  // namespace
}  // namespace tensorshm
