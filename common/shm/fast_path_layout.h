// The fast path's shared memory (see docs/design.md, "The fast path"): the catalog index, which
// the daemon alone writes and clients map read-only, and the lease pages, one per session, the
// only shared memory a client writes. Both come to clients as descriptors over the memory channel.
//
// Index layout (a memfd made at every daemon start):
//   [0, kIndexHeaderBytes)                          IndexHeader
//   [IndexBucketsOffset(), + bucket_count * 8)      IndexBucket[bucket_count]
//   [IndexEntriesOffset(b), + record_count * 24)    IndexEntry[record_count], one per TensorRecord
//
// A bound name is an entry in the chain of bucket NameHash(name) & (bucket_count - 1); entry i
// stands for the TensorRecord in slot i of the control segment, which holds the descriptor. An
// entry whose tensor_id is kIndexAskDaemon stands for a bound name the fast path must not serve
// (its record failed the daemon's check): readers ask the daemon over RPC.
// Each bucket is a seqlock: the daemon makes `sequence` odd, changes the chain, makes it even
// again. A reader takes a consistent snapshot (same even sequence before and after), stores the
// tensor id in a free slot of its lease page, and loads the sequence once more (both sequentially
// consistent): unchanged means the daemon, which unlinks before it scans lease pages, will see
// the slot before it frees the tensor (model: tests/model/fast_path.pml).
#ifndef TENSORSHM_COMMON_SHM_FAST_PATH_LAYOUT_H_
#define TENSORSHM_COMMON_SHM_FAST_PATH_LAYOUT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace tensorshm {

inline constexpr uint64_t kIndexMagic = 0x315844494d534e54ull;  // "TNSMIDX1", little-endian
// The version of the whole fast path's layout: the index and the lease pages (a client checks it
// once, in the index header, before it uses either). 2: lease pages carry the fast acquire
// count and the recent ring (kLeaseAcquireCountSlot, kLeaseRecentSlot).
inline constexpr uint32_t kIndexLayoutVersion = 2;
inline constexpr uint32_t kIndexHeaderBytes = 256;

// The daemon stores its CLOCK_MONOTONIC time in `heartbeat_ns` this often; a client that finds
// it older than kHeartbeatStaleNs takes the daemon as gone and uses the RPCs (which then fail or
// reconnect) instead of the index.
inline constexpr int64_t kHeartbeatIntervalNs = 10'000'000;
inline constexpr int64_t kHeartbeatStaleNs = 100'000'000;

// IndexEntry::tensor_id of a bound name whose record is not to be trusted (never a tensor id).
inline constexpr uint64_t kIndexAskDaemon = 0;

struct IndexHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t bucket_count;  // a power of two
  uint32_t record_count;  // entries: the control segment's record_count
  uint32_t reserved0;
  uint64_t instance_id;  // the daemon start that made it
  // Futex word: incremented after every publish, and when the daemon stops serving.
  std::atomic<uint32_t> publishes;
  std::atomic<uint32_t> serving;  // 1 while the daemon serves; 0 once it began stopping
  std::atomic<int64_t> heartbeat_ns;
  uint8_t reserved[kIndexHeaderBytes - 48];
};

struct IndexBucket {
  std::atomic<uint32_t> sequence;  // odd while the daemon changes the chain
  std::atomic<uint32_t> head;      // record slot + 1 of the first entry; 0: empty
};

struct IndexEntry {
  std::atomic<uint64_t> name_hash;  // NameHash of the bound name
  std::atomic<uint64_t> tensor_id;  // the tensor bound to it (TensorRecord::tensor_id)
  std::atomic<uint32_t> next;       // record slot + 1 of the next entry in the chain; 0: last
  uint32_t reserved;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<int64_t>::is_always_lock_free);
static_assert(std::is_standard_layout_v<IndexHeader>);
static_assert(sizeof(IndexHeader) == kIndexHeaderBytes);
static_assert(offsetof(IndexHeader, instance_id) == 24);
static_assert(offsetof(IndexHeader, publishes) == 32);
static_assert(offsetof(IndexHeader, serving) == 36);
static_assert(offsetof(IndexHeader, heartbeat_ns) == 40);
static_assert(std::is_standard_layout_v<IndexBucket> && sizeof(IndexBucket) == 8);
static_assert(std::is_standard_layout_v<IndexEntry> && sizeof(IndexEntry) == 24);
static_assert(offsetof(IndexEntry, next) == 16);

constexpr uint64_t IndexBucketsOffset() { return kIndexHeaderBytes; }
constexpr uint64_t IndexEntriesOffset(uint32_t bucket_count) {
  return IndexBucketsOffset() + uint64_t{bucket_count} * sizeof(IndexBucket);
}
constexpr uint64_t IndexBytes(uint32_t bucket_count, uint32_t record_count) {
  return IndexEntriesOffset(bucket_count) + uint64_t{record_count} * sizeof(IndexEntry);
}
// Buckets for `record_count` records: the power of two at or above twice as many.
constexpr uint32_t IndexBucketCount(uint32_t record_count) {
  uint32_t buckets = 2;
  while (buckets < 2 * uint64_t{record_count}) buckets *= 2;
  return buckets;
}

// 64-bit FNV-1a of the name, never 0. Both sides hash names with this one function.
inline uint64_t NameHash(const char* name, size_t length) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < length; ++i) {
    hash ^= static_cast<unsigned char>(name[i]);
    hash *= 0x100000001b3ull;
  }
  return hash == 0 ? 1 : hash;
}

// A session's lease page: slots holding the id of a tensor the session reads (0: free). The
// client sets and clears them; the daemon only reads them. Set or clear, never a counter: a
// client that dies mid-operation leaves nothing ambiguous, and its page is dropped whole.
//
// The first kFirstLeaseSlot words are no leases:
// - slot 0 (kLeaseDaemonSlot) is the daemon's word: kLeasePageDropped once the session ended,
//   after which the page protects nothing and the client uses the RPCs;
// - slot 1 (kLeaseAcquireCountSlot) is the client's count of the acquires its fast path served
//   (only the client writes it, one store per acquire, from 0 upwards);
// - slots 2 to 7 (kLeaseRecentSlot, kLeaseRecentSlots) are a ring of the tensor ids of its latest
//   fast acquires: acquire number n (counted from 0) stores its id in slot
//   kLeaseRecentSlot + n % kLeaseRecentSlots, before the count becomes n + 1 (release).
// The daemon reads the count and the ring for its figures and --evict lru's recency, and trusts
// them as no more than numbers a client wrote (see LeaseBoard).
inline constexpr uint32_t kLeasePageBytes = 4096;
inline constexpr uint32_t kLeaseSlots = kLeasePageBytes / sizeof(uint64_t);
inline constexpr uint64_t kLeasePageDropped = ~uint64_t{0};
inline constexpr uint32_t kLeaseDaemonSlot = 0;
inline constexpr uint32_t kLeaseAcquireCountSlot = 1;
inline constexpr uint32_t kLeaseRecentSlot = 2;
inline constexpr uint32_t kLeaseRecentSlots = 6;
inline constexpr uint32_t kFirstLeaseSlot = kLeaseRecentSlot + kLeaseRecentSlots;

struct LeasePage {
  std::atomic<uint64_t> slots[kLeaseSlots];
};
static_assert(std::is_standard_layout_v<LeasePage> && sizeof(LeasePage) == kLeasePageBytes);
static_assert(kFirstLeaseSlot == 8 && kFirstLeaseSlot < kLeaseSlots);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_SHM_FAST_PATH_LAYOUT_H_
