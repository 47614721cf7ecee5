#include "server/catalog/catalog.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {
namespace {

const DLDataType kF32{kDLFloat, 32, 1};
const DLDevice kCpu{kDLCPU, 0};

class CatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = absl::StrCat("tsmtest-catalog-", getpid());
    for (const char* suffix : {".ctl", ".cpu.1", ".cpu.2", ".cpu.3", ".cpu.4", ".cpu.5"}) {
      boost::interprocess::shared_memory_object::remove((prefix_ + suffix).c_str());
    }
    absl::StatusOr<std::unique_ptr<Catalog>> catalog =
        Catalog::Create(CatalogOptions{prefix_, 16 << 20, 4 << 20, 8});
    ASSERT_TRUE(catalog.ok()) << catalog.status();
    catalog_ = *std::move(catalog);
  }

  // The catalog made anew with `options`.
  void Recreate(const CatalogOptions& options) {
    catalog_.reset();
    absl::StatusOr<std::unique_ptr<Catalog>> created = Catalog::Create(options);
    ASSERT_TRUE(created.ok()) << created.status();
    catalog_ = *std::move(created);
  }

  RecordState State(const Tensor* t) {
    return static_cast<RecordState>(catalog_->control().record(t->slot).state.load());
  }

  std::string prefix_;
  std::unique_ptr<Catalog> catalog_;
};

TEST_F(CatalogTest, HeaderIsWrittenWithMagicAndVersion) {
  const ControlHeader& h = catalog_->control().header();
  EXPECT_EQ(h.magic, kControlMagic);
  EXPECT_EQ(h.layout_version, kControlLayoutVersion);
  EXPECT_EQ(h.record_count, 8u);
  EXPECT_EQ(h.tensor_record_bytes, sizeof(TensorRecord));
  EXPECT_EQ(std::string(h.shm_prefix), prefix_);
  const SegmentRecord& s = catalog_->control().segment(0);
  EXPECT_EQ(s.state.load(), static_cast<uint32_t>(SegmentState::kLive));
  EXPECT_EQ(s.size, 4u << 20);
}

TEST_F(CatalogTest, RecordsFollowTheTensorLifecycle) {
  absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {2, 3}, {}, kCpu);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(State(*t), RecordState::kWriting);
  const TensorRecord& record = catalog_->control().record((*t)->slot);
  EXPECT_EQ(record.tensor_id, (*t)->id);
  EXPECT_EQ(record.ndim, 2);
  EXPECT_EQ(record.shape[1], 3);
  EXPECT_EQ(record.strides[0], 3);
  EXPECT_EQ(record.length, 4096u);
  EXPECT_EQ(record.offset % 4096, 0u);

  ASSERT_TRUE(catalog_->Publish(1, (*t)->id, "w", false).ok());
  EXPECT_EQ(State(*t), RecordState::kPublished);
  EXPECT_EQ(std::string(record.name, record.name_length), "w");
  const uint64_t first_seq = record.publish_seq;

  // Replace while leased: the old record is unbound, the new one published with a later seq.
  catalog_->AddLease((*t)->id);
  absl::StatusOr<const Tensor*> t2 = catalog_->Create(1, kF32, {2, 3}, {}, kCpu);
  ASSERT_TRUE(t2.ok());
  ASSERT_TRUE(catalog_->Publish(1, (*t2)->id, "w", true).ok());
  EXPECT_EQ(State(*t), RecordState::kUnbound);
  EXPECT_EQ(State(*t2), RecordState::kPublished);
  EXPECT_GT(catalog_->control().record((*t2)->slot).publish_seq, first_seq);
  const uint32_t old_slot = (*t)->slot;
  catalog_->DropLease((*t)->id);  // frees the old tensor
  EXPECT_EQ(catalog_->control().record(old_slot).state.load(),
            static_cast<uint32_t>(RecordState::kFree));
  EXPECT_EQ(catalog_->tensor_count(), 1);

  const uint32_t slot2 = (*t2)->slot;
  ASSERT_TRUE(catalog_->Delete("w").ok());
  EXPECT_EQ(catalog_->control().record(slot2).state.load(),
            static_cast<uint32_t>(RecordState::kFree));
  EXPECT_EQ(catalog_->host_pool().used_bytes(), 0u);
}

TEST_F(CatalogTest, RecordTableExhaustionIsResourceExhausted) {
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(catalog_->Create(1, kF32, {1}, {}, kCpu).ok());
  absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {1}, {}, kCpu);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(t.status().message().find("--max-tensors"), absl::string_view::npos);
}

TEST_F(CatalogTest, PoolGrowsBySegmentsUpToItsCapacity) {
  // 16 MiB pool of 4 MiB segments.
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {1 << 20}, {}, kCpu);
    ASSERT_TRUE(t.ok()) << i << ": " << t.status();
    EXPECT_EQ((*t)->buffer.segment_id, static_cast<uint64_t>(i + 1));
    ids.push_back((*t)->id);
  }
  EXPECT_EQ(catalog_->host_pool().segment_count(), 4u);
  absl::StatusOr<const Tensor*> full = catalog_->Create(1, kF32, {1}, {}, kCpu);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("0 of 16777216 bytes free"), absl::string_view::npos)
      << full.status();
  ASSERT_TRUE(catalog_->Abandon(1, ids[2]).ok());
  EXPECT_TRUE(catalog_->Create(1, kF32, {1}, {}, kCpu).ok());
}

TEST_F(CatalogTest, OnlyTheCreatorPublishesOrAbandons) {
  absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {4}, {}, kCpu);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(catalog_->Publish(2, (*t)->id, "n", false).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(catalog_->Abandon(2, (*t)->id).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(catalog_->Abandon(1, (*t)->id).ok());
}

TEST_F(CatalogTest, EmptyTensorsTakeNoBuffer) {
  absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {0, 4}, {}, kCpu);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->buffer.length, 0u);
  EXPECT_EQ(catalog_->host_pool().used_bytes(), 0u);
}

// What a restart keeps for reconnecting clients: during the grace period unpublished tensors go
// back only to their creator's uid, leases on sealed tensors are counted again, and nothing
// recovered is freed before the period ends; afterwards nothing can be re-registered.
TEST_F(CatalogTest, RecoveryGracePeriodKeepsWhatReconnectingClientsHold) {
  constexpr uint32_t kUid = 1000;  // the daemon's uid here: its segments are named, recoverable
  const CatalogOptions options{prefix_, 16 << 20, 4 << 20, 8, SegmentBacking::kNamed, kUid, 1};
  ASSERT_NO_FATAL_FAILURE(Recreate(options));
  absl::StatusOr<const Tensor*> published = catalog_->Create(1, kF32, {8}, {}, kCpu, false, kUid);
  absl::StatusOr<const Tensor*> draft = catalog_->Create(1, kF32, {8}, {}, kCpu, false, kUid);
  absl::StatusOr<const Tensor*> leased = catalog_->Create(1, kF32, {8}, {}, kCpu, false, kUid);
  ASSERT_TRUE(published.ok() && draft.ok() && leased.ok());
  const uint64_t published_id = (*published)->id;
  const uint64_t draft_id = (*draft)->id;
  const uint64_t leased_id = (*leased)->id;
  ASSERT_TRUE(catalog_->Publish(1, published_id, "a", false).ok());
  ASSERT_TRUE(catalog_->Publish(1, leased_id, "b", false).ok());
  catalog_->AddLease(leased_id);
  ASSERT_TRUE(catalog_->Delete("b").ok());  // unbound, leased
  EXPECT_FALSE(catalog_->in_grace());
  EXPECT_EQ(catalog_->ReattachLease(leased_id).code(), absl::StatusCode::kFailedPrecondition);

  // The daemon dies; a new one recovers.
  catalog_->KeepSegments();
  catalog_.reset();
  absl::StatusOr<std::unique_ptr<Catalog>> recovered = Catalog::Recover(options);
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  catalog_ = *std::move(recovered);
  ASSERT_TRUE(catalog_->in_grace());
  EXPECT_EQ(catalog_->tensor_count(), 3);
  EXPECT_EQ(catalog_->FindId(published_id)->owner_uid, kUid);
  EXPECT_FALSE(catalog_->FindId(draft_id)->sealed);
  EXPECT_EQ(catalog_->FindId(draft_id)->owner_session, 0u);
  EXPECT_EQ(catalog_->host_pool().used_bytes(), 3u * 4096);

  EXPECT_EQ(catalog_->Readopt(7, kUid + 1, draft_id).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(catalog_->Readopt(7, kUid, 999).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(catalog_->ReattachLease(draft_id).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(catalog_->Readopt(7, kUid, draft_id).ok());
  EXPECT_EQ(catalog_->Readopt(8, kUid, draft_id).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(catalog_->ReattachLease(leased_id).ok());

  // Nothing recovered is freed in the grace period: not a deleted name, not a dropped lease.
  ASSERT_TRUE(catalog_->Delete("a").ok());
  catalog_->DropLease(leased_id);
  EXPECT_NE(catalog_->FindId(published_id), nullptr);
  EXPECT_NE(catalog_->FindId(leased_id), nullptr);
  EXPECT_EQ(catalog_->host_pool().used_bytes(), 3u * 4096);

  EXPECT_EQ(catalog_->ExpireUnbound(), 2);
  EXPECT_FALSE(catalog_->in_grace());
  EXPECT_EQ(catalog_->tensor_count(), 1);
  EXPECT_EQ(catalog_->host_pool().used_bytes(), 4096u);
  EXPECT_EQ(catalog_->ReattachLease(leased_id).code(), absl::StatusCode::kFailedPrecondition);
  // The taken-back draft is its new session's to publish.
  ASSERT_TRUE(catalog_->Publish(7, draft_id, "c", false).ok());
}

// The free ends given back (HostPool::TrimTail) stay given back across a restart: the recovered
// pool holds what the old one held, not the objects' full sizes, and takes the rest.
TEST_F(CatalogTest, RecoveryKeepsTheFreeEndsGivenBack) {
  constexpr uint32_t kUid = 1000;  // the daemon's uid here: its segments are named, recoverable
  const CatalogOptions options{prefix_, 16 << 20, 4 << 20, 8, SegmentBacking::kNamed, kUid, 1};
  ASSERT_NO_FATAL_FAILURE(Recreate(options));
  for (int i = 0; i < 5; ++i) {  // 3 MiB each: the last fits only in the ends given back
    absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {3 << 18}, {}, kCpu, false, kUid);
    ASSERT_TRUE(t.ok()) << "tensor " << i << ": " << t.status();
    ASSERT_TRUE(catalog_->Publish(1, (*t)->id, absl::StrCat("t", i), false).ok());
  }
  const uint64_t reserved = catalog_->host_pool().reserved_bytes();
  EXPECT_LE(reserved, uint64_t{16} << 20);
  EXPECT_LT(reserved, catalog_->host_pool().segment_count() * (uint64_t{4} << 20));

  catalog_->KeepSegments();
  catalog_.reset();
  absl::StatusOr<std::unique_ptr<Catalog>> recovered = Catalog::Recover(options);
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  catalog_ = *std::move(recovered);
  EXPECT_EQ(catalog_->tensor_count(), 5);
  EXPECT_EQ(catalog_->host_pool().reserved_bytes(), reserved);
  EXPECT_EQ(catalog_->host_pool().used_bytes(), uint64_t{15} << 20);
  EXPECT_EQ(catalog_->host_pool().largest_free_bytes(), uint64_t{1} << 20);
  absl::StatusOr<const Tensor*> last = catalog_->Create(1, kF32, {1 << 18}, {}, kCpu, false, kUid);
  EXPECT_TRUE(last.ok()) << last.status();
}

// Another uid's buffers live in a segment of its own, a sealed memfd (its writable descriptor
// cannot resize what others map). A restart loses it: its tensors are dropped, its id stays a
// hole, and the rest of the pool is recovered as usual.
TEST_F(CatalogTest, AnotherUidsSegmentIsAMemfdThatRecoveryLeavesAsAHole) {
  absl::StatusOr<const Tensor*> own = catalog_->Create(1, kF32, {8}, {}, kCpu, false, 0);
  absl::StatusOr<const Tensor*> other = catalog_->Create(2, kF32, {8}, {}, kCpu, false, 1000);
  ASSERT_TRUE(own.ok() && other.ok());
  const uint64_t own_id = (*own)->id;
  const uint64_t other_id = (*other)->id;
  ASSERT_EQ((*own)->buffer.segment_id, 1u);
  ASSERT_EQ((*other)->buffer.segment_id, 2u);
  EXPECT_EQ(catalog_->host_pool().Segment(1).backing(), SegmentBacking::kNamed);
  EXPECT_EQ(catalog_->host_pool().Segment(2).backing(), SegmentBacking::kMemfd);
  EXPECT_EQ(catalog_->control().segment(1).owner_uid, 1000u);
  const uint64_t lost_instance = catalog_->host_pool().SegmentInstance(2);
  ASSERT_TRUE(catalog_->Publish(1, own_id, "own", false).ok());
  ASSERT_TRUE(catalog_->Publish(2, other_id, "other", false).ok());

  catalog_->KeepSegments();
  catalog_.reset();
  absl::StatusOr<std::unique_ptr<Catalog>> recovered =
      Catalog::Recover(CatalogOptions{prefix_, 16 << 20, 4 << 20, 8});
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  catalog_ = *std::move(recovered);
  EXPECT_NE(catalog_->Find("own"), nullptr);
  EXPECT_EQ(catalog_->Find("other"), nullptr);
  EXPECT_TRUE(catalog_->host_pool().HasSegment(1));
  EXPECT_FALSE(catalog_->host_pool().HasSegment(2));
  EXPECT_EQ(catalog_->host_pool().used_bytes(), 4096u);
  // uid 1000 produces again, in a new segment of its own: the hole's id, under a new instance (a
  // client's mapping of the lost memfd, keyed by instance and id, is never taken for it).
  absl::StatusOr<const Tensor*> again = catalog_->Create(3, kF32, {8}, {}, kCpu, false, 1000);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->buffer.segment_id, 2u);
  EXPECT_NE(catalog_->host_pool().SegmentInstance(2), lost_instance);
  EXPECT_EQ(catalog_->control().segment(1).instance, catalog_->host_pool().SegmentInstance(2));
}

}  // namespace
}  // namespace tensorshm

namespace tensorshm {
namespace {

// The index as a client sees it: the record slot + 1 bound to `name`, or 0.
uint32_t IndexLookup(const CatalogIndex& index, const std::string& name) {
  const auto* base = reinterpret_cast<const char*>(&index.header());
  const uint32_t buckets = index.header().bucket_count;
  const uint64_t hash = NameHash(name.data(), name.size());
  const auto* bucket =
      reinterpret_cast<const IndexBucket*>(base + IndexBucketsOffset()) + (hash & (buckets - 1));
  const auto* entries = reinterpret_cast<const IndexEntry*>(base + IndexEntriesOffset(buckets));
  EXPECT_EQ(bucket->sequence.load() % 2, 0u);
  for (uint32_t link = bucket->head.load(); link != 0; link = entries[link - 1].next.load()) {
    if (entries[link - 1].name_hash.load() == hash) return link;
  }
  return 0;
}

// A lease page as its client maps it.
struct MappedPage {
  // Maps the page `fd` (OpenLeasePage's, which keeps it) brings.
  explicit MappedPage(int fd) {
    address = mmap(nullptr, kLeasePageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  ~MappedPage() { munmap(address, kLeasePageBytes); }
  LeasePage& page() { return *static_cast<LeasePage*>(address); }
  void* address;
};

TEST_F(CatalogTest, IndexFollowsPublishReplaceAndDelete) {
  const CatalogIndex& index = catalog_->index();
  EXPECT_EQ(index.header().magic, kIndexMagic);
  EXPECT_EQ(index.header().record_count, 8u);
  EXPECT_EQ(index.header().bucket_count, 16u);
  EXPECT_EQ(index.header().serving.load(), 1u);
  const uint32_t before = index.header().publishes.load();

  absl::StatusOr<const Tensor*> a = catalog_->Create(1, kF32, {4}, {}, kCpu);
  ASSERT_TRUE(a.ok());
  const uint32_t a_slot = (*a)->slot;
  const uint64_t a_id = (*a)->id;
  EXPECT_EQ(IndexLookup(index, "x"), 0u) << "unpublished tensors are not in the index";
  ASSERT_TRUE(catalog_->Publish(1, a_id, "x", false).ok());
  EXPECT_EQ(IndexLookup(index, "x"), a_slot + 1);
  EXPECT_EQ(index.header().publishes.load(), before + 1);

  absl::StatusOr<const Tensor*> b = catalog_->Create(1, kF32, {4}, {}, kCpu);
  ASSERT_TRUE(b.ok());
  const uint32_t b_slot = (*b)->slot;
  ASSERT_TRUE(catalog_->Publish(1, (*b)->id, "x", true).ok());
  EXPECT_EQ(IndexLookup(index, "x"), b_slot + 1);
  EXPECT_EQ(catalog_->FindId(a_id), nullptr) << "unleased: freed at once";

  ASSERT_TRUE(catalog_->Delete("x").ok());
  EXPECT_EQ(IndexLookup(index, "x"), 0u);
}

TEST_F(CatalogTest, LeasePageSlotKeepsReplacedTensorUntilClearedAndReclaimed) {
  absl::StatusOr<UniqueFd> fd = catalog_->OpenLeasePage(7, 0);
  ASSERT_TRUE(fd.ok()) << fd.status();
  MappedPage mapped(fd->get());
  absl::StatusOr<const Tensor*> a = catalog_->Create(1, kF32, {1024}, {}, kCpu);
  ASSERT_TRUE(a.ok());
  const uint64_t a_id = (*a)->id;
  const uint64_t used = catalog_->host_pool().used_bytes();
  ASSERT_TRUE(catalog_->Publish(1, a_id, "x", false).ok());
  mapped.page().slots[kFirstLeaseSlot + 3].store(a_id);
  catalog_->ReadLeasePages();
  EXPECT_EQ(catalog_->LeaseCount(*catalog_->FindId(a_id)), 1);
  EXPECT_EQ(catalog_->PageLeaseCount(), 1);

  ASSERT_TRUE(catalog_->Delete("x").ok());
  ASSERT_NE(catalog_->FindId(a_id), nullptr) << "a lease page slot holds it";
  EXPECT_EQ(catalog_->retired_count(), 1u);
  EXPECT_EQ(State(catalog_->FindId(a_id)), RecordState::kUnbound);
  EXPECT_EQ(catalog_->Reclaim(), 0);
  EXPECT_EQ(catalog_->host_pool().used_bytes(), used);

  mapped.page().slots[kFirstLeaseSlot + 3].store(0);
  EXPECT_EQ(catalog_->Reclaim(), 1);
  EXPECT_EQ(catalog_->FindId(a_id), nullptr);
  EXPECT_EQ(catalog_->retired_count(), 0u);
  EXPECT_EQ(catalog_->host_pool().used_bytes(), 0u);
}

TEST_F(CatalogTest, DroppedLeasePageFreesWhatOnlyItHeldAndTellsItsClient) {
  absl::StatusOr<UniqueFd> fd = catalog_->OpenLeasePage(7, 0);
  ASSERT_TRUE(fd.ok());
  MappedPage mapped(fd->get());
  absl::StatusOr<const Tensor*> a = catalog_->Create(1, kF32, {4}, {}, kCpu);
  ASSERT_TRUE(a.ok());
  const uint64_t a_id = (*a)->id;
  ASSERT_TRUE(catalog_->Publish(1, a_id, "x", false).ok());
  mapped.page().slots[kFirstLeaseSlot].store(a_id);
  ASSERT_TRUE(catalog_->Delete("x").ok());
  ASSERT_NE(catalog_->FindId(a_id), nullptr);
  catalog_->DropLeasePage(7);
  EXPECT_EQ(mapped.page().slots[kLeaseDaemonSlot].load(), kLeasePageDropped);
  EXPECT_EQ(catalog_->Reclaim(), 1);
  EXPECT_EQ(catalog_->FindId(a_id), nullptr);
}

// The words before kFirstLeaseSlot are no leases: a count and a ring of ids there pin nothing.
TEST_F(CatalogTest, LeasePageCountAndRingHoldNoTensor) {
  absl::StatusOr<UniqueFd> fd = catalog_->OpenLeasePage(7, 0);
  ASSERT_TRUE(fd.ok());
  MappedPage mapped(fd->get());
  absl::StatusOr<const Tensor*> a = catalog_->Create(1, kF32, {4}, {}, kCpu);
  ASSERT_TRUE(a.ok());
  const uint64_t a_id = (*a)->id;
  ASSERT_TRUE(catalog_->Publish(1, a_id, "x", false).ok());
  for (uint32_t slot = 1; slot < kFirstLeaseSlot; ++slot) mapped.page().slots[slot].store(a_id);
  catalog_->ReadLeasePages();
  EXPECT_EQ(catalog_->PageLeaseCount(), 0);
  EXPECT_EQ(catalog_->PageLeasesOf(7), 0);
  ASSERT_TRUE(catalog_->Delete("x").ok());
  EXPECT_EQ(catalog_->FindId(a_id), nullptr) << "freed at once: no lease slot holds it";
}

// Fast acquire counts are numbers a client wrote: summed over pages (a dropped page's too),
// never decreasing, and a count that goes back or leaps is taken sanely.
TEST_F(CatalogTest, FastAcquireCountsAddUpNeverDecreaseAndAreClamped) {
  absl::StatusOr<UniqueFd> fd7 = catalog_->OpenLeasePage(7, 0);
  absl::StatusOr<UniqueFd> fd8 = catalog_->OpenLeasePage(8, 0);
  ASSERT_TRUE(fd7.ok() && fd8.ok());
  MappedPage page7(fd7->get());
  MappedPage page8(fd8->get());
  EXPECT_EQ(catalog_->FastAcquires(), 0u);
  page7.page().slots[kLeaseAcquireCountSlot].store(5);
  page8.page().slots[kLeaseAcquireCountSlot].store(3);
  EXPECT_EQ(catalog_->FastAcquires(), 8u);
  EXPECT_EQ(catalog_->FastAcquires(), 8u) << "read twice, counted once";
  // A count that goes back adds nothing, and the page counts on from there.
  page7.page().slots[kLeaseAcquireCountSlot].store(2);
  EXPECT_EQ(catalog_->FastAcquires(), 8u);
  page7.page().slots[kLeaseAcquireCountSlot].store(4);
  EXPECT_EQ(catalog_->FastAcquires(), 10u);
  // A leap adds at most kMaxAcquiresPerRead.
  page8.page().slots[kLeaseAcquireCountSlot].store(~uint64_t{0});
  EXPECT_EQ(catalog_->FastAcquires(), 10u + LeaseBoard::kMaxAcquiresPerRead);
  // What a page counted before its session ended stays counted.
  page7.page().slots[kLeaseAcquireCountSlot].store(9);
  catalog_->DropLeasePage(7);
  EXPECT_EQ(catalog_->FastAcquires(), 15u + LeaseBoard::kMaxAcquiresPerRead);
}

// --evict lru: a tensor acquired and released between two rounds (only the recent ring says
// so) counts as used at the round that read the ring.
TEST_F(CatalogTest, RecentRingMarksTensorsUsedThoughNoSlotHoldsThem) {
  absl::StatusOr<UniqueFd> fd = catalog_->OpenLeasePage(7, 0);
  ASSERT_TRUE(fd.ok());
  MappedPage mapped(fd->get());
  std::vector<uint64_t> ids;
  for (const char* name : {"old", "new"}) {
    absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {4}, {}, kCpu);
    ASSERT_TRUE(t.ok());
    ids.push_back((*t)->id);
    ASSERT_TRUE(catalog_->Publish(1, (*t)->id, name, false).ok());
  }
  catalog_->TouchHeld();
  const uint64_t new_seq = catalog_->FindId(ids[1])->use_seq;
  ASSERT_GT(new_seq, catalog_->FindId(ids[0])->use_seq);
  // "old" acquired and released in the fast path: ring entry 0, count 1.
  mapped.page().slots[kLeaseRecentSlot].store(ids[0]);
  mapped.page().slots[kLeaseAcquireCountSlot].store(1);
  catalog_->TouchHeld();
  EXPECT_GT(catalog_->FindId(ids[0])->use_seq, new_seq);
  EXPECT_TRUE(catalog_->FindId(ids[0])->acquired);
  // Read once: the next round, with the count unchanged, touches nothing.
  const uint64_t old_seq = catalog_->FindId(ids[0])->use_seq;
  catalog_->TouchHeld();
  EXPECT_EQ(catalog_->FindId(ids[0])->use_seq, old_seq);
}

// A page is its client's to write: ids written before their tensor was published (or never
// handed out) are no leases and keep nothing, whatever the tensor does later.
TEST_F(CatalogTest, LeasePageSlotWrittenBeforePublishPinsNothing) {
  absl::StatusOr<UniqueFd> fd = catalog_->OpenLeasePage(7, 0);
  ASSERT_TRUE(fd.ok());
  MappedPage mapped(fd->get());
  const uint64_t next = catalog_->next_tensor_id();
  for (uint32_t i = 0; i < 4; ++i) mapped.page().slots[kFirstLeaseSlot + i].store(next + i);
  mapped.page().slots[kFirstLeaseSlot + 4].store(uint64_t{1} << 50);
  catalog_->ReadLeasePages();
  absl::StatusOr<const Tensor*> a = catalog_->Create(1, kF32, {1024}, {}, kCpu);
  ASSERT_TRUE(a.ok());
  const uint64_t a_id = (*a)->id;
  ASSERT_EQ(a_id, next);
  ASSERT_TRUE(catalog_->Publish(1, a_id, "x", false).ok());
  catalog_->ReadLeasePages();
  EXPECT_EQ(catalog_->PageLeaseCount(), 0);
  EXPECT_EQ(catalog_->LeaseCount(*catalog_->FindId(a_id)), 0);
  ASSERT_TRUE(catalog_->Delete("x").ok());
  EXPECT_EQ(catalog_->FindId(a_id), nullptr) << "freed at once";
  EXPECT_EQ(catalog_->host_pool().used_bytes(), 0u);
}

// A publish-and-acquire leases its own unpublished tensor in the page before the publish: that
// slot counts (another session's unpublished tensor does not).
TEST_F(CatalogTest, LeasePageSlotOfOwnUnpublishedTensorCountsAndPins) {
  absl::StatusOr<UniqueFd> fd = catalog_->OpenLeasePage(7, 0);
  ASSERT_TRUE(fd.ok());
  MappedPage mapped(fd->get());
  absl::StatusOr<const Tensor*> own = catalog_->Create(7, kF32, {1024}, {}, kCpu);
  absl::StatusOr<const Tensor*> other = catalog_->Create(8, kF32, {1024}, {}, kCpu);
  ASSERT_TRUE(own.ok() && other.ok());
  const uint64_t own_id = (*own)->id;
  const uint64_t other_id = (*other)->id;
  mapped.page().slots[kFirstLeaseSlot].store(own_id);
  mapped.page().slots[kFirstLeaseSlot + 1].store(other_id);
  catalog_->ReadLeasePages();
  EXPECT_EQ(catalog_->PageLeaseCount(), 1);
  ASSERT_TRUE(catalog_->Publish(7, own_id, "own", false).ok());
  ASSERT_TRUE(catalog_->Publish(8, other_id, "other", false).ok());
  catalog_->ReadLeasePages();
  EXPECT_EQ(catalog_->LeaseCount(*catalog_->FindId(own_id)), 1);
  EXPECT_EQ(catalog_->LeaseCount(*catalog_->FindId(other_id)), 0);
  ASSERT_TRUE(catalog_->Delete("own").ok());
  ASSERT_TRUE(catalog_->Delete("other").ok());
  EXPECT_NE(catalog_->FindId(own_id), nullptr) << "its slot holds it";
  EXPECT_EQ(catalog_->FindId(other_id), nullptr);
  mapped.page().slots[kFirstLeaseSlot].store(0);
  EXPECT_EQ(catalog_->Reclaim(), 1);
}

// A slot the client wrote while the name was bound counts even if no read saw it before the
// delete (the delete reads the pages); one written after the delete does not.
TEST_F(CatalogTest, LeasePageSlotWrittenWhileBoundPinsUntilCleared) {
  absl::StatusOr<UniqueFd> fd = catalog_->OpenLeasePage(7, 0);
  ASSERT_TRUE(fd.ok());
  MappedPage mapped(fd->get());
  std::vector<uint64_t> ids;
  for (const char* name : {"x", "y"}) {
    absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {1024}, {}, kCpu);
    ASSERT_TRUE(t.ok());
    ids.push_back((*t)->id);
    ASSERT_TRUE(catalog_->Publish(1, (*t)->id, name, false).ok());
  }
  catalog_->ReadLeasePages();
  mapped.page().slots[kFirstLeaseSlot].store(ids[0]);  // no read in between
  ASSERT_TRUE(catalog_->Delete("x").ok());
  ASSERT_TRUE(catalog_->Delete("y").ok());
  EXPECT_NE(catalog_->FindId(ids[0]), nullptr) << "held by the slot";
  EXPECT_EQ(catalog_->FindId(ids[1]), nullptr);
  // Written after the delete: not a lease; the freed id stays free.
  mapped.page().slots[kFirstLeaseSlot + 1].store(ids[1]);
  catalog_->ReadLeasePages();
  EXPECT_EQ(catalog_->PageLeaseCount(), 1);
  // The pinned slot rewritten to the same id after a clear is not taken in again.
  mapped.page().slots[kFirstLeaseSlot].store(0);
  catalog_->ReadLeasePages();
  mapped.page().slots[kFirstLeaseSlot].store(ids[0]);
  EXPECT_EQ(catalog_->Reclaim(), 1);
  EXPECT_EQ(catalog_->FindId(ids[0]), nullptr);
  EXPECT_EQ(catalog_->PageLeaseCount(), 0);
}

// Slots count against --uid-leases with the uid's RPC leases; past it they are ignored.
TEST_F(CatalogTest, LeasePageSlotsCountWithinUidLeases) {
  UidLimits limits(UidLimitsConfig{0, 2, 0, 0});
  catalog_->CountPageLeasesIn(&limits);
  absl::StatusOr<UniqueFd> fd = catalog_->OpenLeasePage(7, 1000);
  ASSERT_TRUE(fd.ok());
  MappedPage mapped(fd->get());
  std::vector<uint64_t> ids;
  for (const char* name : {"a", "b", "c"}) {
    absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {1024}, {}, kCpu);
    ASSERT_TRUE(t.ok());
    ids.push_back((*t)->id);
    ASSERT_TRUE(catalog_->Publish(1, (*t)->id, name, false).ok());
  }
  for (uint32_t i = 0; i < 3; ++i) mapped.page().slots[kFirstLeaseSlot + i].store(ids[i]);
  catalog_->ReadLeasePages();
  EXPECT_EQ(catalog_->PageLeaseCount(), 2);
  EXPECT_EQ(catalog_->PageLeasesOf(7), 2);
  EXPECT_EQ(limits.Usage(1000).leases, 2u);
  for (const char* name : {"a", "b", "c"}) ASSERT_TRUE(catalog_->Delete(name).ok());
  EXPECT_EQ(catalog_->retired_count(), 2u);
  EXPECT_EQ(catalog_->FindId(ids[2]), nullptr) << "the slot past the limit keeps nothing";
  EXPECT_EQ(catalog_->DropLeasePage(7), 2);
  EXPECT_EQ(limits.Usage(1000).leases, 0u);
  EXPECT_EQ(catalog_->Reclaim(), 2);
  catalog_->CountPageLeasesIn(nullptr);
}

// A read takes in at most kMaxChangesPerRead changed slots; the next reads go on from there.
TEST_F(CatalogTest, LeasePageReadsAreBoundedAndGoOn) {
  std::vector<std::unique_ptr<MappedPage>> pages;
  for (uint64_t session = 1; session <= 10; ++session) {
    absl::StatusOr<UniqueFd> fd = catalog_->OpenLeasePage(session, 0);
    ASSERT_TRUE(fd.ok());
    pages.push_back(std::make_unique<MappedPage>(fd->get()));
  }
  absl::StatusOr<const Tensor*> t = catalog_->Create(1, kF32, {4}, {}, kCpu);
  ASSERT_TRUE(t.ok());
  const uint64_t id = (*t)->id;
  ASSERT_TRUE(catalog_->Publish(1, id, "x", false).ok());
  for (auto& page : pages) {
    for (uint32_t i = kFirstLeaseSlot; i < kLeaseSlots; ++i) page->page().slots[i].store(id);
  }
  const int64_t all = 10 * (kLeaseSlots - kFirstLeaseSlot);
  catalog_->ReadLeasePages();
  EXPECT_EQ(catalog_->PageLeaseCount(), LeaseBoard::kMaxChangesPerRead);
  catalog_->ReadLeasePages();
  EXPECT_EQ(catalog_->PageLeaseCount(), all);
  EXPECT_EQ(catalog_->LeaseCount(*catalog_->FindId(id)), all);
}

// Stocked buffers are stock until published or freed.
TEST_F(CatalogTest, StockIsCountedUntilPublishedOrFreed) {
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<const Tensor*> t =
        catalog_->Create(1, DLDataType{kDLUInt, 8, 1}, {4096}, {}, kCpu);
    ASSERT_TRUE(t.ok());
    ids.push_back((*t)->id);
    catalog_->MarkStocked((*t)->id);
  }
  EXPECT_EQ(catalog_->stocked_tensors(), 3);
  EXPECT_EQ(catalog_->stock_bytes(), 3u * 4096);
  ASSERT_TRUE(catalog_->Publish(1, ids[0], "made", false).ok());
  ASSERT_TRUE(catalog_->Abandon(1, ids[1]).ok());
  EXPECT_EQ(catalog_->stocked_tensors(), 1);
  EXPECT_EQ(catalog_->stock_bytes(), 4096u);
  EXPECT_EQ(catalog_->host_pool().used_bytes(), 2u * 4096) << "stock is allocated from the pool";
}

TEST_F(CatalogTest, ReshapeGivesAStockedBufferItsDescriptorOnlyIfItFits) {
  absl::StatusOr<const Tensor*> t =
      catalog_->Create(1, DLDataType{kDLUInt, 8, 1}, {4096}, {}, kCpu);
  ASSERT_TRUE(t.ok());
  const uint64_t id = (*t)->id;
  EXPECT_EQ(catalog_->Reshape(2, id, kF32, {8}, {}, false).code(),
            absl::StatusCode::kPermissionDenied);
  absl::Status too_big = catalog_->Reshape(1, id, kF32, {2048}, {}, false);
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument) << too_big;
  EXPECT_NE(too_big.message().find("do not fit"), std::string::npos) << too_big;
  EXPECT_EQ(catalog_->Reshape(1, id, kF32, {-1}, {}, false).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(catalog_->Reshape(1, id, kF32, {4, 256}, {}, false).ok());
  const TensorRecord& record = catalog_->control().record((*t)->slot);
  EXPECT_EQ(record.dtype_code, kDLFloat);
  EXPECT_EQ(record.ndim, 2);
  EXPECT_EQ(record.shape[1], 256);
  EXPECT_EQ(record.strides[0], 256);
  EXPECT_EQ(record.nbytes, 4096);
  ASSERT_TRUE(catalog_->Publish(1, id, "y", false).ok());
  EXPECT_EQ(catalog_->Reshape(1, id, kF32, {8}, {}, false).code(),
            absl::StatusCode::kFailedPrecondition);
}

// A daemon killed between making segment 2 and recording it leaves /<prefix>.cpu.2 behind; the
// next daemon removes it and grows to segment 2 as if it had never been made.
TEST_F(CatalogTest, RecoveryRemovesASegmentItsDaemonMadeButNeverRecorded) {
  const CatalogOptions options{
      prefix_, 16 << 20, 4 << 20, 8, SegmentBacking::kNamed, uint32_t(geteuid()), 1};
  catalog_.reset();
  absl::StatusOr<std::unique_ptr<Catalog>> created = Catalog::Create(options);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_EQ((*created)->host_pool().segment_count(), 1u);
  (*created)->KeepSegments();
  created->reset();
  const std::string orphan = "/" + prefix_ + ".cpu.2";
  const int fd = shm_open(orphan.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0) << orphan;
  ASSERT_EQ(ftruncate(fd, 4 << 20), 0);
  close(fd);

  absl::StatusOr<std::unique_ptr<Catalog>> recovered = Catalog::Recover(options);
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  catalog_ = *std::move(recovered);
  // Two 4 MiB tensors: the second needs segment 2.
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<const Tensor*> t =
        catalog_->Create(1, kF32, {1 << 20}, {}, kCpu, false, uint32_t(geteuid()));
    ASSERT_TRUE(t.ok()) << i << ": " << t.status();
    EXPECT_EQ((*t)->buffer.segment_id, static_cast<uint64_t>(i + 1));
  }
  EXPECT_EQ(catalog_->host_pool().segment_count(), 2u);
}

}  // namespace
}  // namespace tensorshm
