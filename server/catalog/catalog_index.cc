#include "server/catalog/catalog_index.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "server/ops/log.h"

namespace tensorshm {

int64_t MonotonicNanos() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

absl::StatusOr<CatalogIndex> CatalogIndex::Create(uint32_t record_count, uint64_t instance_id) {
  const uint32_t buckets = IndexBucketCount(record_count);
  absl::StatusOr<ShmSegment> shm =
      ShmSegment::Create(absl::StrCat("/tensorshm-index-", instance_id),
                         IndexBytes(buckets, record_count), /*map=*/true, SegmentBacking::kMemfd);
  if (!shm.ok()) return shm.status();
  CatalogIndex index(*std::move(shm), buckets, record_count);
  // A fresh memfd is all zeros: every bucket empty at sequence 0.
  IndexHeader& header = index.mutable_header();
  header.layout_version = kIndexLayoutVersion;
  header.bucket_count = buckets;
  header.record_count = record_count;
  header.instance_id = instance_id;
  header.heartbeat_ns.store(MonotonicNanos(), std::memory_order_relaxed);
  header.serving.store(1, std::memory_order_relaxed);
  header.magic = kIndexMagic;  // clients get the index through a socket, which orders it
  return index;
}

IndexBucket& CatalogIndex::bucket(uint64_t name_hash) {
  auto* buckets =
      reinterpret_cast<IndexBucket*>(static_cast<char*>(shm_.address()) + IndexBucketsOffset());
  return buckets[name_hash & (bucket_count_ - 1)];
}

IndexEntry& CatalogIndex::entry(uint32_t slot) {
  TSM_CHECK(slot < record_count_);
  auto* entries = reinterpret_cast<IndexEntry*>(static_cast<char*>(shm_.address()) +
                                                IndexEntriesOffset(bucket_count_));
  return entries[slot];
}

void CatalogIndex::Unlink(IndexBucket& bucket, uint32_t slot) {
  std::atomic<uint32_t>* link = &bucket.head;
  for (uint32_t steps = 0; steps <= record_count_; ++steps) {
    const uint32_t current = link->load(std::memory_order_relaxed);
    if (current == 0) return;
    if (current == slot + 1) {
      uint32_t next = entry(slot).next.load(std::memory_order_relaxed);
      if (next > record_count_) next = 0;
      link->store(next, std::memory_order_release);
      return;
    }
    if (current > record_count_) break;
    link = &entry(current - 1).next;
  }
  // Only another process writing the index makes a chain loop or leave the table: the chain ends
  // here, and the entries past this link leave the fast path (their names go to the RPCs).
  TSM_LOG(kError) << "catalog index: a chain does not read as the daemon wrote it (another "
                     "process wrote the index); cut short";
  link->store(0, std::memory_order_release);
}

void CatalogIndex::Bind(uint64_t name_hash, uint32_t slot, uint64_t tensor_id,
                        std::optional<uint32_t> replaced_slot) {
  IndexBucket& chain = bucket(name_hash);
  const uint32_t sequence = chain.sequence.load(std::memory_order_relaxed);
  // Odd first. The stores of the change are releases, so a reader that sees any of them sees
  // the odd sequence after it too (rather than a fence, which ThreadSanitizer does not model).
  chain.sequence.store(sequence + 1, std::memory_order_relaxed);
  if (replaced_slot.has_value()) Unlink(chain, *replaced_slot);
  IndexEntry& added = entry(slot);
  added.name_hash.store(name_hash, std::memory_order_release);
  added.tensor_id.store(tensor_id, std::memory_order_release);
  added.next.store(chain.head.load(std::memory_order_relaxed), std::memory_order_release);
  chain.head.store(slot + 1, std::memory_order_release);
  // Sequentially consistent: ordered before the lease page scan that follows an unlink.
  chain.sequence.store(sequence + 2, std::memory_order_seq_cst);
}

void CatalogIndex::Unbind(uint64_t name_hash, uint32_t slot) {
  IndexBucket& chain = bucket(name_hash);
  const uint32_t sequence = chain.sequence.load(std::memory_order_relaxed);
  chain.sequence.store(sequence + 1, std::memory_order_relaxed);
  Unlink(chain, slot);
  chain.sequence.store(sequence + 2, std::memory_order_seq_cst);
}

void CatalogIndex::NotifyPublished() {
  mutable_header().publishes.fetch_add(1, std::memory_order_seq_cst);
  WakeWaiters();
}

void CatalogIndex::WakeWaiters() {
  // Not FUTEX_PRIVATE_FLAG: the waiters are other processes mapping the same memfd.
  syscall(SYS_futex, &mutable_header().publishes, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void CatalogIndex::Heartbeat() {
  mutable_header().heartbeat_ns.store(MonotonicNanos(), std::memory_order_release);
}

void CatalogIndex::StopServing() {
  mutable_header().serving.store(0, std::memory_order_seq_cst);
  NotifyPublished();
}

}  // namespace tensorshm
