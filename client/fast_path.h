// The client's fast path (docs/design.md, "The fast path"): acquire and release through shared
// memory, without a system call. It maps the daemon's catalog index and control segment read-only
// and the session's lease page read-write, all three from descriptors the memory channel brings.
#ifndef TENSORSHM_CLIENT_FAST_PATH_H_
#define TENSORSHM_CLIENT_FAST_PATH_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/memory_channel.h"
#include "common/base/mapping.h"
#include "common/base/mutex.h"
#include "common/shm/catalog_layout.h"
#include "common/shm/fast_path_layout.h"
#include "common/shm/tensor_record.h"

namespace tensorshm {

// One session's fast path. Thread-safe. Lives as long as any tensor leased through it: its
// mappings go with the last holder.
class FastPath {
 public:
  // Asks the daemon (over `channel`, bound to `session_token`) for the three parts and maps
  // them. The daemon's refusal keeps its code; a part that does not look like what this client
  // expects is FAILED_PRECONDITION (the caller then uses the RPCs alone).
  static absl::StatusOr<std::shared_ptr<FastPath>> Open(MemoryChannel& channel,
                                                        const std::string& session_token);
  ~FastPath();
  FastPath(const FastPath&) = delete;
  FastPath& operator=(const FastPath&) = delete;

  enum class Outcome {
    kLeased,    // `Leased` describes the tensor; its id is in a slot of the lease page
    kNotFound,  // no tensor is bound to the name now
    kFallback,  // the fast path cannot answer (daemon gone or stopping, page full, a busy
                // index, an empty CUDA tensor): ask the daemon over RPC
  };
  // A tensor as its record described it, copied out of shared memory once and checked: nothing
  // in it is read from the control segment again.
  struct Leased {
    uint32_t page_slot = 0;
    uint64_t tensor_id = 0;
    RecordLayout layout;      // dtype, shape, resolved strides, byte offset and span
    uint64_t segment_id = 0;  // the buffer: [offset, offset + length) of the segment
    uint64_t offset = 0;
    uint64_t length = 0;            // 0: an empty tensor without a buffer
    uint64_t segment_instance = 0;  // of the buffer's segment (length > 0)
    // CUDA tensors (device_uuid not empty): the device's 16-byte UUID and the producer's 64-byte
    // CUipcEventHandle; the segment is one of the device's pool (this daemon instance's), which
    // the caller must map already and check the range against.
    std::string device_uuid;
    std::string ready_event;
  };
  // Looks `name` up in the index and, if bound, takes a lease slot on it. Never a system call.
  // The control segment may hold anything (another process of the daemon's uid can write it):
  // a record that does not describe `name`'s tensor consistently is kFallback, never a crash or
  // a read outside a mapping. The caller still checks that [offset, offset + length) lies in the
  // segment it maps.
  Outcome TryAcquire(std::string_view name, Leased* leased) ABSL_LOCKS_EXCLUDED(mu_);

  // Takes a lease slot on `tensor_id`, a tensor of this session not yet published: from its
  // publish on the slot keeps it as a lease found through the index would. False when there is
  // no free slot (or the fast path is retired).
  bool Pin(uint64_t tensor_id, uint32_t* page_slot) ABSL_LOCKS_EXCLUDED(mu_);

  // Gives lease slot `page_slot` back: true, with one atomic store, while this fast path is the
  // session's. After Retire, false with `*key` set to the client-side key the slot's lease was
  // turned into.
  bool Release(uint32_t page_slot, uint64_t* key) ABSL_LOCKS_EXCLUDED(mu_);

  // After Retire: true, with the key slot `page_slot`'s lease was turned into. False before.
  bool ConvertedKey(uint32_t page_slot, uint64_t* key) const ABSL_LOCKS_EXCLUDED(mu_);

  // The session ended (the daemon restarted): no new leases; `convert(tensor_id)` is called for
  // every slot still held, under this fast path's lock, and returns the key the slot's lease
  // lives on as (see Release). Returns how many slots were converted.
  int Retire(const std::function<uint64_t(uint64_t tensor_id)>& convert) ABSL_LOCKS_EXCLUDED(mu_);

  // Appends the ids of the tensors the daemon holds memory for now (every record not free:
  // unpublished, published, or unbound but leased), read from its control segment; unsorted.
  // A tensor held from before the call until after it is always among them. Reads
  // record_count() records: no system call, no lock.
  void HeldTensorIds(std::vector<uint64_t>* ids) const;
  uint32_t record_count() const { return record_count_; }

  // Whether the daemon is serving and alive (its heartbeat is fresh).
  bool DaemonServing() const;
  // The futex word the daemon bumps after every publish.
  uint32_t publishes() const { return index_header().publishes.load(std::memory_order_acquire); }
  // Sleeps until the daemon bumps the word from `seen`, or `timeout` passes (at most), or a
  // signal interrupts; spins briefly first. Woken without a bump (the daemon wakes waiters as a
  // publish arrives, before its commit), it looks for the bump up to 30 us more, yielding. The
  // caller looks at the index again either way: a return says nothing about what is published.
  void WaitForPublish(uint32_t seen, absl::Duration timeout) const;
  // Wakes the threads sleeping in WaitForPublish (every process's: they look again and, with
  // nothing published, sleep again), for a wait cancelled in this process.
  void WakePublishWaiters() const;
  uint64_t instance_id() const { return index_header().instance_id; }

 private:
  FastPath() = default;
  const IndexHeader& index_header() const {
    return *reinterpret_cast<const IndexHeader*>(index_.data());
  }
  LeasePage& page() const { return *reinterpret_cast<LeasePage*>(page_.data()); }
  // Fills `leased` (but its page slot and id) from a checked copy of record `record_slot`, which
  // the index says is `name`'s tensor `tensor_id`; false if the copy does not describe that
  // tensor consistently. REQUIRES: record_slot < record_count_.
  bool Describe(uint32_t record_slot, uint64_t tensor_id, std::string_view name,
                Leased* leased) const;

  Mapping index_;              // read-only
  Mapping records_;            // read-only: the control segment
  bool catalog_kept_ = false;  // records_ is in sealed_ranges (to name a tensor a write hits)
  Mapping page_;               // read-write
  const IndexBucket* buckets_ = nullptr;
  const IndexEntry* entries_ = nullptr;
  uint32_t bucket_count_ = 0;
  uint32_t record_count_ = 0;

  mutable Mutex mu_;  // slot ownership: taken for a few loads and stores, never across a call
  std::vector<uint32_t> free_slots_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> converted_keys_ ABSL_GUARDED_BY(mu_);  // by slot, after Retire
  bool retired_ ABSL_GUARDED_BY(mu_) = false;
  // Acquires TryAcquire served, as stored in the lease page's kLeaseAcquireCountSlot (kept here:
  // the page's word is only ever written by this process).
  uint64_t acquires_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_FAST_PATH_H_
