// The catalog index (common/shm/fast_path_layout.h): bound names in shared memory, written by the
// daemon alone, read by clients through a read-only mapping to acquire without an RPC.
#ifndef TENSORSHM_SERVER_CATALOG_CATALOG_INDEX_H_
#define TENSORSHM_SERVER_CATALOG_CATALOG_INDEX_H_

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "common/base/unique_fd.h"
#include "common/shm/fast_path_layout.h"
#include "server/memory/shm_segment.h"

namespace tensorshm {

// Thread-compatible: the catalog serialises the writers. Heartbeat and StopServing may run
// concurrently with them (they touch only header atomics). Move-only.
//
// The daemon writes the index alone, but a process of its uid could reopen the memfd writable
// (through /proc): the bucket and record counts are kept here, and a chain that does not read as
// the daemon left it is cut short, never followed out of bounds or forever.
class CatalogIndex {
 public:
  // A memfd index for `record_count` records, empty and serving. Errors as ShmSegment::Create.
  static absl::StatusOr<CatalogIndex> Create(uint32_t record_count, uint64_t instance_id);

  // Binds the name hashing to `name_hash` to the tensor in record `slot`; `replaced_slot` is the
  // record the name was bound to until now, if any, unlinked in the same step so that a reader
  // never finds the name missing in between. REQUIRES: slot < record_count, not linked.
  void Bind(uint64_t name_hash, uint32_t slot, uint64_t tensor_id,
            std::optional<uint32_t> replaced_slot);
  // Unlinks record `slot` from the chain of `name_hash`; nothing if it is not there.
  void Unbind(uint64_t name_hash, uint32_t slot);

  // Bumps `publishes` and wakes every client waiting for a publish (FUTEX_WAKE).
  void NotifyPublished();
  // Wakes every waiting client without a bump: a publish has arrived and its commit (and
  // NotifyPublished) follows within microseconds. A waiter's wake-up from sleep then overlaps
  // the commit instead of following it; it looks for the bump for a bounded time
  // (FastPath::WaitForPublish) and sleeps again if none comes (the publish was refused).
  void WakeWaiters();
  // Stores the daemon's monotonic clock as its sign of life.
  void Heartbeat();
  // Tells clients the daemon is stopping: they use the RPCs from now on.
  void StopServing();

  // A new read-only descriptor of the index, for a client.
  absl::StatusOr<UniqueFd> OpenForClient() const { return shm_.OpenForClient(/*writable=*/false); }
  uint64_t size() const { return shm_.size(); }
  const IndexHeader& header() const { return *static_cast<IndexHeader*>(shm_.address()); }

 private:
  CatalogIndex(ShmSegment shm, uint32_t bucket_count, uint32_t record_count)
      : shm_(std::move(shm)), bucket_count_(bucket_count), record_count_(record_count) {}
  IndexHeader& mutable_header() { return *static_cast<IndexHeader*>(shm_.address()); }
  IndexBucket& bucket(uint64_t name_hash);
  IndexEntry& entry(uint32_t slot);
  // Removes `slot` from `bucket`'s chain. REQUIRES: the bucket's sequence is odd.
  void Unlink(IndexBucket& bucket, uint32_t slot);

  ShmSegment shm_;
  uint32_t bucket_count_;  // a power of two
  uint32_t record_count_;
};

// CLOCK_MONOTONIC in nanoseconds (the heartbeat's clock).
int64_t MonotonicNanos();

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CATALOG_CATALOG_INDEX_H_
