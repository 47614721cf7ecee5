#include "client/fast_path.h"

#include <dlpack/dlpack.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "client/sealed_ranges.h"
#include "common/base/sys_error.h"
#include "common/shm/tensor_record.h"

namespace tensorshm {
namespace {

// Attempts at a consistent snapshot of a bucket before giving the question to the daemon.
constexpr int kSnapshotAttempts = 8;
// Pause loops before sleeping on the futex word. Short: on a machine with few cores a longer
// spin (50 us was tried) takes the CPU the producer and the daemon need to publish.
constexpr int kSpinRounds = 256;
// After a wake-up that left the word as it was (most likely the daemon's, sent as a publish
// arrives and before its commit: CatalogIndex::WakeWaiters), how long a waiter looks for the
// bump before it sleeps again. It yields between looks: on a busy machine the CPU goes to the
// daemon, which is committing.
constexpr int64_t kCommitWaitNs = 30'000;
// The longest futex sleep: waiters look at the daemon's heartbeat at least this often.
constexpr absl::Duration kLongestSleep = absl::Milliseconds(100);

int64_t MonotonicNow() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);  // the vDSO: no system call
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Asks for one part and maps it: read-only, or read-write for the lease page.
absl::StatusOr<Mapping> MapPart(MemoryChannel& channel, const std::string& session_token,
                                v1::FastPathRequest::Part part) {
  v1::ChannelRequest request;
  request.mutable_fast_path()->set_part(part);
  UniqueFd fd;
  absl::StatusOr<v1::ChannelResponse> response = channel.Exchange(session_token, request, &fd);
  if (!response.ok()) return response.status();
  const std::string label = absl::StrCat("fast path part ", v1::FastPathRequest::Part_Name(part));
  if (!fd.valid() || !response->has_fast_path() || response->fast_path().part() != part ||
      response->fast_path().size() == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        label, ": the daemon granted something else (", response->ShortDebugString(), ")"));
  }
  const size_t size = response->fast_path().size();
  const bool writable = part == v1::FastPathRequest::LEASE_PAGE;
  Mapping mapped(
      mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd.get(), 0),
      size);
  const int err = errno;
  fd.reset();  // the mapping keeps the object
  if (!mapped.valid()) return ErrnoError("mmap", label, err);
  return mapped;
}

}  // namespace

absl::StatusOr<std::shared_ptr<FastPath>> FastPath::Open(MemoryChannel& channel,
                                                         const std::string& session_token) {
  std::shared_ptr<FastPath> fast(new FastPath());
  absl::StatusOr<Mapping> index = MapPart(channel, session_token, v1::FastPathRequest::INDEX);
  if (!index.ok()) return index.status();
  fast->index_ = *std::move(index);
  absl::StatusOr<Mapping> records = MapPart(channel, session_token, v1::FastPathRequest::RECORDS);
  if (!records.ok()) return records.status();
  fast->records_ = *std::move(records);
  absl::StatusOr<Mapping> page = MapPart(channel, session_token, v1::FastPathRequest::LEASE_PAGE);
  if (!page.ok()) return page.status();
  fast->page_ = *std::move(page);

  // The daemon is trusted, but its layout version may not be this client's. The control
  // segment's header may be written by another process at any time: each word is read once.
  if (fast->index_.size() < sizeof(IndexHeader) || fast->records_.size() < sizeof(ControlHeader) ||
      fast->page_.size() < kLeasePageBytes) {
    return absl::FailedPreconditionError(
        "fast path: the daemon's index or control segment is smaller than its header");
  }
  const IndexHeader& header = fast->index_header();
  const auto* control = reinterpret_cast<const ControlHeader*>(fast->records_.data());
  const uint32_t buckets = __atomic_load_n(&header.bucket_count, __ATOMIC_RELAXED);
  const uint32_t record_count = __atomic_load_n(&header.record_count, __ATOMIC_RELAXED);
  if (header.magic != kIndexMagic || header.layout_version != kIndexLayoutVersion || buckets == 0 ||
      (buckets & (buckets - 1)) != 0 || fast->index_.size() < IndexBytes(buckets, record_count) ||
      __atomic_load_n(&control->magic, __ATOMIC_RELAXED) != kControlMagic ||
      __atomic_load_n(&control->layout_version, __ATOMIC_RELAXED) != kControlLayoutVersion ||
      fast->records_.size() < ControlSegmentBytes(record_count)) {
    return absl::FailedPreconditionError(
        "fast path: the daemon's index or control segment is not of this client's layout");
  }
  // A client in another time namespace reads another monotonic clock: it cannot judge the
  // daemon's heartbeat, and stays on the RPCs.
  const int64_t skew = MonotonicNow() - header.heartbeat_ns.load(std::memory_order_acquire);
  if (skew > 10 * kHeartbeatStaleNs || skew < -10 * kHeartbeatStaleNs) {
    return absl::FailedPreconditionError(absl::StrCat("fast path: the daemon's monotonic clock is ",
                                                      skew, " ns off this process's"));
  }
  sealed_ranges::AddCatalog(fast->records_.data(), fast->records_.size());
  fast->catalog_kept_ = true;
  fast->bucket_count_ = buckets;
  fast->record_count_ = record_count;
  fast->buckets_ = reinterpret_cast<const IndexBucket*>(fast->index_.data() + IndexBucketsOffset());
  fast->entries_ =
      reinterpret_cast<const IndexEntry*>(fast->index_.data() + IndexEntriesOffset(buckets));
  MutexLock lock(&fast->mu_);
  fast->free_slots_.reserve(kLeaseSlots - kFirstLeaseSlot);
  for (uint32_t slot = kLeaseSlots - 1; slot >= kFirstLeaseSlot; --slot) {
    fast->free_slots_.push_back(slot);
  }
  return fast;
}

FastPath::~FastPath() {
  // Out of sealed_ranges before the mappings go with it.
  if (catalog_kept_) sealed_ranges::RemoveCatalog(records_.data());
}

void FastPath::HeldTensorIds(std::vector<uint64_t>* ids) const {
  const char* first = records_.data() + RecordsOffset();
  for (uint32_t slot = 0; slot < record_count_; ++slot) {
    const auto* record = reinterpret_cast<const TensorRecord*>(first + slot * sizeof(TensorRecord));
    // The id is written before the state (release); a record being rewritten meanwhile belongs
    // to a tensor created or freed during the call.
    if (record->state.load(std::memory_order_acquire) ==
        static_cast<uint32_t>(RecordState::kFree)) {
      continue;
    }
    ids->push_back(record->tensor_id);
  }
}

bool FastPath::DaemonServing() const {
  const IndexHeader& header = index_header();
  if (header.serving.load(std::memory_order_acquire) == 0) return false;
  return MonotonicNow() - header.heartbeat_ns.load(std::memory_order_acquire) < kHeartbeatStaleNs;
}

FastPath::Outcome FastPath::TryAcquire(std::string_view name, Leased* leased) {
  if (!DaemonServing()) return Outcome::kFallback;
  const uint64_t hash = NameHash(name.data(), name.size());
  const IndexBucket& bucket = buckets_[hash & (bucket_count_ - 1)];
  MutexLock lock(&mu_);
  if (retired_ || free_slots_.empty()) return Outcome::kFallback;
  LeasePage& lease_page = page();
  if (lease_page.slots[kLeaseDaemonSlot].load(std::memory_order_acquire) == kLeasePageDropped) {
    return Outcome::kFallback;
  }
  for (int attempt = 0; attempt < kSnapshotAttempts; ++attempt) {
    // A consistent snapshot of the bucket's chain: the entry hashing like `name`, if any.
    const uint32_t sequence = bucket.sequence.load(std::memory_order_acquire);
    if (sequence & 1) {
      CpuRelax();
      continue;
    }
    uint32_t found = 0;  // record slot + 1
    uint64_t tensor_id = 0;
    // Acquire loads keep the sequence's second load after them (rather than a fence, which
    // ThreadSanitizer does not model).
    uint32_t link = bucket.head.load(std::memory_order_acquire);
    for (uint32_t steps = 0; link != 0 && link <= record_count_ && steps < record_count_; ++steps) {
      const IndexEntry& entry = entries_[link - 1];
      if (entry.name_hash.load(std::memory_order_acquire) == hash) {
        found = link;
        tensor_id = entry.tensor_id.load(std::memory_order_acquire);
        break;
      }
      link = entry.next.load(std::memory_order_acquire);
    }
    if (bucket.sequence.load(std::memory_order_relaxed) != sequence) continue;
    if (found == 0) return Outcome::kNotFound;
    // Bound, but the daemon does not trust the record: it answers over RPC.
    if (tensor_id == kIndexAskDaemon) return Outcome::kFallback;

    // Hazard: the slot first, then the bucket again. Unchanged, the daemon (which unlinks
    // before it scans lease pages) sees the slot before it could free the tensor.
    const uint32_t page_slot = free_slots_.back();
    lease_page.slots[page_slot].store(tensor_id, std::memory_order_seq_cst);
    if (bucket.sequence.load(std::memory_order_seq_cst) != sequence) {
      lease_page.slots[page_slot].store(0, std::memory_order_release);
      continue;
    }
    if (!Describe(found - 1, tensor_id, name, leased)) {
      lease_page.slots[page_slot].store(0, std::memory_order_release);
      return Outcome::kFallback;
    }
    free_slots_.pop_back();
    leased->page_slot = page_slot;
    leased->tensor_id = tensor_id;
    // Tells the daemon (its figures, --evict lru) of this acquire: the ring entry, then the
    // count that covers it. Two plain stores to a line this thread owns.
    lease_page.slots[kLeaseRecentSlot + acquires_ % kLeaseRecentSlots].store(
        tensor_id, std::memory_order_relaxed);
    ++acquires_;
    lease_page.slots[kLeaseAcquireCountSlot].store(acquires_, std::memory_order_release);
    return Outcome::kLeased;
  }
  return Outcome::kFallback;
}

bool FastPath::Describe(uint32_t record_slot, uint64_t tensor_id, std::string_view name,
                        Leased* leased) const {
  const auto& shared = *reinterpret_cast<const TensorRecord*>(
      records_.data() + RecordsOffset() + uint64_t{record_slot} * sizeof(TensorRecord));
  shared.state.load(std::memory_order_acquire);  // orders the copy after the daemon's commit
  TensorRecord record;
  CopyRecord(shared, record);
  // The record is stable from here while the slot holds the tensor, unless another process
  // writes it: every field is checked on the copy. A hash shared by two names goes to the daemon.
  const auto state = static_cast<RecordState>(record.state.load(std::memory_order_relaxed));
  const bool cuda = record.device_type == kDLCUDA;
  if ((state != RecordState::kPublished && state != RecordState::kUnbound) ||
      record.tensor_id != tensor_id || name.size() > sizeof(record.name) ||
      record.name_length != name.size() ||
      std::memcmp(record.name, name.data(), name.size()) != 0 ||
      (!cuda && (record.device_type != kDLCPU || record.device_id != 0))) {
    return false;
  }
  absl::StatusOr<RecordLayout> layout = DecodeRecordLayout(record);
  if (!layout.ok()) return false;
  uint64_t end = 0;
  if (cuda) {
    // A CUDA segment is not in the control segment's table: the caller checks the range against
    // its own mapping of it. An empty CUDA tensor, or one without its ready event, is the
    // daemon's to describe.
    static constexpr uint8_t kZeros[sizeof(record.ready_event)] = {};
    if (record.length == 0 || __builtin_add_overflow(record.offset, record.length, &end) ||
        std::memcmp(record.ready_event, kZeros, sizeof(record.ready_event)) == 0) {
      return false;
    }
    leased->segment_instance = instance_id();
    leased->device_uuid.assign(reinterpret_cast<const char*>(record.device_uuid),
                               sizeof(record.device_uuid));
    leased->ready_event.assign(reinterpret_cast<const char*>(record.ready_event),
                               sizeof(record.ready_event));
  } else if (record.length > 0) {
    if (record.segment_id < 1 || record.segment_id > kMaxSegments ||
        __builtin_add_overflow(record.offset, record.length, &end)) {
      return false;
    }
    SegmentRecord segment;
    CopyRecord(
        *reinterpret_cast<const SegmentRecord*>(records_.data() + kControlHeaderBytes +
                                                (record.segment_id - 1) * sizeof(SegmentRecord)),
        segment);
    if (segment.state.load(std::memory_order_relaxed) ==
            static_cast<uint32_t>(SegmentState::kUnused) ||
        segment.segment_id != record.segment_id || end > segment.size) {
      return false;
    }
    leased->segment_instance = segment.instance;
  }
  leased->layout = *std::move(layout);
  leased->segment_id = record.segment_id;
  leased->offset = record.offset;
  leased->length = record.length;
  return true;
}

bool FastPath::Pin(uint64_t tensor_id, uint32_t* page_slot) {
  MutexLock lock(&mu_);
  if (retired_ || free_slots_.empty() ||
      page().slots[kLeaseDaemonSlot].load(std::memory_order_acquire) == kLeasePageDropped) {
    return false;
  }
  *page_slot = free_slots_.back();
  free_slots_.pop_back();
  page().slots[*page_slot].store(tensor_id, std::memory_order_seq_cst);
  return true;
}

bool FastPath::Release(uint32_t page_slot, uint64_t* key) {
  MutexLock lock(&mu_);
  if (retired_) {
    *key = converted_keys_[page_slot];
    return false;
  }
  page().slots[page_slot].store(0, std::memory_order_release);
  free_slots_.push_back(page_slot);
  return true;
}

bool FastPath::ConvertedKey(uint32_t page_slot, uint64_t* key) const {
  MutexLock lock(&mu_);
  if (!retired_) return false;
  *key = converted_keys_[page_slot];
  return true;
}

int FastPath::Retire(const std::function<uint64_t(uint64_t tensor_id)>& convert) {
  MutexLock lock(&mu_);
  if (retired_) return 0;
  retired_ = true;
  converted_keys_.assign(kLeaseSlots, 0);
  std::vector<bool> free(kLeaseSlots, false);
  for (uint32_t slot : free_slots_) free[slot] = true;
  int converted = 0;
  for (uint32_t slot = kFirstLeaseSlot; slot < kLeaseSlots; ++slot) {
    if (free[slot]) continue;
    converted_keys_[slot] = convert(page().slots[slot].load(std::memory_order_relaxed));
    ++converted;
  }
  return converted;
}

void FastPath::WaitForPublish(uint32_t seen, absl::Duration timeout) const {
  const std::atomic<uint32_t>& word = index_header().publishes;
  for (int i = 0; i < kSpinRounds; ++i) {
    if (word.load(std::memory_order_acquire) != seen) return;
    CpuRelax();
  }
  const absl::Duration sleep = std::min(timeout, kLongestSleep);
  if (sleep <= absl::ZeroDuration()) return;
  const timespec relative = absl::ToTimespec(sleep);
  // A shared futex (no FUTEX_PRIVATE_FLAG): the daemon wakes it from its own mapping. EAGAIN
  // (the word moved on), EINTR and ETIMEDOUT all mean: look again.
  if (syscall(SYS_futex, &word, FUTEX_WAIT, seen, &relative, nullptr, 0) != 0) return;
  // Woken with the word unchanged: a publish arrived at the daemon, its commit and bump a few
  // microseconds behind (or a cancel, or a publish the daemon refuses). Look for the bump for a
  // bounded time; the caller then looks the name up, and sleeps again on a miss.
  const int64_t until = MonotonicNow() + std::min(kCommitWaitNs, absl::ToInt64Nanoseconds(sleep));
  while (word.load(std::memory_order_acquire) == seen && MonotonicNow() < until) sched_yield();
}

void FastPath::WakePublishWaiters() const {
  // FUTEX_WAKE only reads the word: the read-only mapping of the index serves.
  syscall(SYS_futex, &index_header().publishes, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace tensorshm
