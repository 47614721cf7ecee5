// The catalog against another process of its uid writing its control segment: records that no
// longer say what the daemon wrote make their tensors DATA_LOSS, header words the daemon relies
// on are its own, and recovery takes the larger of the header's counters and the records'.
#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>
#include <cstring>
#include <iostream>
#include <optional>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/catalog/catalog.h"

namespace tensorshm {
namespace {

const DLDataType kF32{kDLFloat, 32, 1};
const DLDevice kCpu{kDLCPU, 0};
constexpr uint32_t kRecords = 8;

class CatalogDamageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = absl::StrCat("tsmtest-damage-", getpid());
    RemoveLeftovers();
    absl::StatusOr<std::unique_ptr<Catalog>> catalog = Catalog::Create(Options());
    ASSERT_TRUE(catalog.ok()) << catalog.status();
    catalog_ = *std::move(catalog);
  }
  void TearDown() override {
    catalog_.reset();
    RemoveLeftovers();
  }
  void RemoveLeftovers() {
    for (const char* suffix : {".ctl", ".cpu.1", ".cpu.2", ".cpu.3"}) {
      boost::interprocess::shared_memory_object::remove((prefix_ + suffix).c_str());
    }
  }
  CatalogOptions Options() const {
    return CatalogOptions{prefix_, 16 << 20, 4 << 20, kRecords, SegmentBacking::kNamed, 0, 1};
  }

  // Creates and publishes a 4-float tensor as `name`; returns its id.
  uint64_t Publish(const std::string& name, bool replace = false) {
    absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {4}, {}, kCpu);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return 0;
    const uint64_t id = (*t)->id;
    EXPECT_TRUE(catalog_->Publish(1, id, name, replace).ok());
    return id;
  }
  TensorRecord& Record(uint64_t tensor_id) {
    return catalog_->control().record(catalog_->FindId(tensor_id)->slot);
  }

  // The index entry's tensor id for `name` as a client reads it, or nullopt if unbound there.
  std::optional<uint64_t> IndexEntryId(const std::string& name) const {
    const CatalogIndex& index = catalog_->index();
    const auto* base = reinterpret_cast<const char*>(&index.header());
    const uint32_t buckets = index.header().bucket_count;
    const uint64_t hash = NameHash(name.data(), name.size());
    const auto* bucket =
        reinterpret_cast<const IndexBucket*>(base + IndexBucketsOffset()) + (hash & (buckets - 1));
    const auto* entries = reinterpret_cast<const IndexEntry*>(base + IndexEntriesOffset(buckets));
    for (uint32_t link = bucket->head.load(); link != 0; link = entries[link - 1].next.load()) {
      if (entries[link - 1].name_hash.load() == hash) return entries[link - 1].tensor_id.load();
    }
    return std::nullopt;
  }

  std::string prefix_;
  std::unique_ptr<Catalog> catalog_;
};

TEST_F(CatalogDamageTest, OverwrittenRecordIsDataLossNamingTheTensorAndWhatWasFound) {
  const uint64_t id = Publish("victim");
  const uint64_t other = Publish("bystander");
  ASSERT_TRUE(catalog_->Verify(id).ok());
  EXPECT_EQ(IndexEntryId("victim"), id);

  Record(id).tensor_id = 0xdeadbeef;
  // The sweep finds it (and only it), once.
  EXPECT_EQ(catalog_->CheckRecords(kRecords), 1);
  EXPECT_EQ(catalog_->CheckRecords(kRecords), 0);
  EXPECT_EQ(catalog_->damaged_count(), 1);
  const absl::Status status = catalog_->Verify(id);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  std::cout << "Verify: " << status << std::endl;
  EXPECT_TRUE(absl::StrContains(status.message(), "\"victim\"")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), absl::StrCat("tensor ", id))) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), prefix_ + ".ctl")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "overwritten by another process")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "tensor_id 3735928559")) << status;
  // Still bound (Acquire says DATA_LOSS rather than NOT_FOUND), but the index sends readers to
  // the daemon.
  ASSERT_NE(catalog_->Find("victim"), nullptr);
  EXPECT_EQ(IndexEntryId("victim"), kIndexAskDaemon);
  EXPECT_TRUE(catalog_->Verify(other).ok());
  EXPECT_EQ(IndexEntryId("bystander"), other);

  // Its publisher deletes it; its memory is freed as usual (no lease holds it).
  const uint64_t used = catalog_->host_pool().used_bytes();
  ASSERT_TRUE(catalog_->Delete("victim").ok());
  EXPECT_EQ(catalog_->FindId(id), nullptr);
  EXPECT_EQ(catalog_->host_pool().used_bytes(), used - 4096);
  EXPECT_EQ(IndexEntryId("victim"), std::nullopt);
  EXPECT_EQ(catalog_->damaged_count(), 0);
}

TEST_F(CatalogDamageTest, ADamagedTensorIsReplacedAndItsSlotRewrittenWhenReused) {
  const uint64_t id = Publish("x");
  catalog_->AddLease(id);  // a reader holds it
  const uint32_t slot = catalog_->FindId(id)->slot;
  // Another process scribbles the whole record.
  std::memset(static_cast<void*>(&Record(id)), 0xa5, sizeof(TensorRecord));
  EXPECT_EQ(catalog_->Verify(id).code(), absl::StatusCode::kDataLoss);

  const uint64_t replacement = Publish("x", /*replace=*/true);
  EXPECT_TRUE(catalog_->Verify(replacement).ok());
  EXPECT_EQ(IndexEntryId("x"), replacement);
  ASSERT_NE(catalog_->FindId(id), nullptr) << "the lease keeps the damaged tensor's memory";
  catalog_->DropLease(id);
  EXPECT_EQ(catalog_->FindId(id), nullptr);

  // The slot is reused (the free list is last in, first out): rewritten whole.
  absl::StatusOr<const Tensor*> reused = catalog_->Create(1, kF32, {2}, {}, kCpu);
  ASSERT_TRUE(reused.ok()) << reused.status();
  ASSERT_EQ((*reused)->slot, slot);
  const TensorRecord& record = catalog_->control().record(slot);
  EXPECT_EQ(record.tensor_id, (*reused)->id);
  EXPECT_EQ(record.name_length, 0u);
  EXPECT_EQ(record.dlpack_flags, 0u);
  EXPECT_EQ(record.shape[1], 0) << "no byte of the scribble is left";
  EXPECT_EQ(record.reserved[0], 0);
  EXPECT_TRUE(catalog_->Verify((*reused)->id).ok());
  EXPECT_TRUE(catalog_->Publish(1, (*reused)->id, "y", false).ok());
}

TEST_F(CatalogDamageTest, AnUnpublishedTensorWithAnOverwrittenRecordIsNotPublished) {
  absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {4}, {}, kCpu);
  ASSERT_TRUE(t.ok());
  const uint64_t id = (*t)->id;
  Record(id).shape[0] = 1 << 30;
  const absl::Status status = catalog_->Publish(1, id, "never", false);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "shape[0] 1073741824")) << status;
  EXPECT_EQ(catalog_->Find("never"), nullptr);
  EXPECT_EQ(IndexEntryId("never"), std::nullopt);
  EXPECT_TRUE(catalog_->Abandon(1, id).ok());
  EXPECT_EQ(catalog_->tensor_count(), 0);
}

TEST_F(CatalogDamageTest, HeaderScribblesMoveNeitherCountersNorTheRecordCount) {
  const uint64_t first = Publish("a");
  ControlHeader& header = catalog_->control().header();
  const uint64_t seq_before = catalog_->next_publish_seq();
  header.record_count = 0xffffffffu;
  header.next_tensor_id.store(1);  // ids already handed out
  header.next_publish_seq.store(~uint64_t{0});
  header.magic = 0;

  EXPECT_EQ(catalog_->control().record_count(), kRecords);
  const uint64_t second = Publish("b");
  EXPECT_EQ(second, first + 1);
  EXPECT_EQ(catalog_->next_publish_seq(), seq_before + 1);
  // The daemon's words are stored back for a later recovery.
  EXPECT_EQ(header.next_tensor_id.load(), second + 1);
  EXPECT_EQ(header.next_publish_seq.load(), seq_before + 1);
  EXPECT_TRUE(catalog_->Verify(first).ok());
  EXPECT_TRUE(catalog_->Verify(second).ok());
  EXPECT_EQ(catalog_->CheckRecords(kRecords), 0) << "header words are not records";
  // The sweep wrote the header back, for later clients and a later recovery.
  EXPECT_EQ(header.magic, kControlMagic);
  EXPECT_EQ(header.record_count, kRecords);
  EXPECT_EQ(header.next_publish_seq.load(), seq_before + 1);

  // Exactly kRecords tensors fit, whatever the header says.
  for (uint32_t i = 2; i < kRecords; ++i) {
    ASSERT_TRUE(catalog_->Create(1, kF32, {1}, {}, kCpu).ok());
  }
  EXPECT_EQ(catalog_->Create(1, kF32, {1}, {}, kCpu).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(CatalogDamageTest, RecoveryTakesTheLargerOfTheHeadersCountersAndTheRecords) {
  const uint64_t a = Publish("a");
  const uint64_t b = Publish("b");
  const uint64_t c = Publish("c");
  ASSERT_TRUE(catalog_->Delete("c").ok());  // freed: its id is only in the header now
  const uint64_t next_id = catalog_->next_tensor_id();
  const uint64_t next_seq = catalog_->next_publish_seq();
  ASSERT_EQ(next_id, c + 1);

  auto recover = [&]() {
    catalog_->KeepSegments();
    catalog_.reset();
    absl::StatusOr<std::unique_ptr<Catalog>> recovered = Catalog::Recover(Options());
    ASSERT_TRUE(recovered.ok()) << recovered.status();
    catalog_ = *std::move(recovered);
  };
  // The header is the larger: ids freed before the restart are not handed out again.
  recover();
  EXPECT_EQ(catalog_->next_tensor_id(), next_id);
  EXPECT_EQ(catalog_->next_publish_seq(), next_seq);
  EXPECT_NE(catalog_->Find("a"), nullptr);

  // The records are the larger (the header was written back by another process).
  catalog_->control().header().next_tensor_id.store(1);
  catalog_->control().header().next_publish_seq.store(0);
  recover();
  EXPECT_EQ(catalog_->next_tensor_id(), b + 1);
  EXPECT_EQ(catalog_->next_publish_seq(), catalog_->FindId(b)->publish_seq + 1);

  // A header word no daemon reaches is ignored, not wrapped around.
  catalog_->control().header().next_tensor_id.store(~uint64_t{0});
  catalog_->control().header().next_publish_seq.store(~uint64_t{0} - 5);
  recover();
  EXPECT_EQ(catalog_->next_tensor_id(), b + 1);
  EXPECT_EQ(catalog_->control().header().next_tensor_id.load(), b + 1);
  EXPECT_NE(catalog_->Find("a"), nullptr);
  EXPECT_EQ(catalog_->Find("a")->id, a);
  catalog_->ExpireUnbound();
  const uint64_t d = Publish("d");
  EXPECT_EQ(d, b + 1);
}

TEST_F(CatalogDamageTest, ScribbledSegmentRecordsAreWrittenBackSoThatRecoveryFindsThePool) {
  const uint64_t a = Publish("a");
  SegmentRecord& first = catalog_->control().segment(0);
  const SegmentRecord& unused = catalog_->control().segment(5);
  const uint64_t size = first.size;
  const uint64_t instance = first.instance;
  first.size = 12345;
  first.segment_id = 9;
  first.instance = 7;
  catalog_->control().segment(5).state.store(static_cast<uint32_t>(SegmentState::kLive));
  catalog_->control().header().magic = 42;

  EXPECT_EQ(catalog_->CheckRecords(kRecords), 0);
  EXPECT_EQ(first.size, size);
  EXPECT_EQ(first.segment_id, 1u);
  EXPECT_EQ(first.instance, instance);
  EXPECT_EQ(first.state.load(), static_cast<uint32_t>(SegmentState::kLive));
  EXPECT_EQ(unused.state.load(), static_cast<uint32_t>(SegmentState::kUnused));

  catalog_->KeepSegments();
  catalog_.reset();
  absl::StatusOr<std::unique_ptr<Catalog>> recovered = Catalog::Recover(Options());
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  catalog_ = *std::move(recovered);
  ASSERT_NE(catalog_->Find("a"), nullptr);
  EXPECT_EQ(catalog_->Find("a")->id, a);
}

TEST_F(CatalogDamageTest, ARecordScribbledBeforeARestartIsDroppedByRecovery) {
  const uint64_t good = Publish("good");
  const uint64_t bad = Publish("bad");
  Record(bad).ndim = 1000;
  catalog_->KeepSegments();
  catalog_.reset();
  absl::StatusOr<std::unique_ptr<Catalog>> recovered = Catalog::Recover(Options());
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  catalog_ = *std::move(recovered);
  EXPECT_NE(catalog_->Find("good"), nullptr);
  EXPECT_EQ(catalog_->Find("bad"), nullptr);
  EXPECT_EQ(catalog_->FindId(bad), nullptr);
  EXPECT_TRUE(catalog_->Verify(good).ok());
}

// Random bytes anywhere in the control segment (header, segment records, tensor records) while
// the catalog works: it never aborts, and every tensor is either intact or DATA_LOSS.
TEST_F(CatalogDamageTest, RandomScribblesWhileWorkingNeverStopTheCatalog) {
  constexpr uint32_t kSeed = 20240611;
  std::mt19937_64 random(kSeed);
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  char* base = reinterpret_cast<char*>(&catalog_->control().header());
  const uint64_t size = catalog_->control().size();
  int damaged = 0;
  for (int round = 0; round < 2000; ++round) {
    for (int i = 0; i < 4; ++i) base[random() % size] = static_cast<char>(random());
    const std::string name = absl::StrCat("t", round % 5);
    absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {4, 2}, {}, kCpu);
    if (t.ok()) {
      const absl::Status s = catalog_->Publish(1, (*t)->id, name, /*replace=*/true);
      if (!s.ok()) {
        EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
        EXPECT_TRUE(catalog_->Abandon(1, (*t)->id).ok());
      }
    } else {
      EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << t.status();
    }
    damaged += catalog_->CheckRecords(3);
    if (const Tensor* found = catalog_->Find(name); found != nullptr) {
      const absl::Status s = catalog_->Verify(found->id);
      EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kDataLoss) << s;
    }
    if (round % 7 == 0) (void)catalog_->Delete(absl::StrCat("t", random() % 5));
  }
  std::cout << "tensors found damaged: " << damaged << ", tensors now " << catalog_->tensor_count()
            << std::endl;
  EXPECT_GT(damaged, 0);
  EXPECT_EQ(catalog_->control().record_count(), kRecords);
}

}  // namespace
}  // namespace tensorshm
