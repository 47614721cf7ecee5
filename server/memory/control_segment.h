// The control segment holding the catalog records (see common/shm/catalog_layout.h).
#ifndef TENSORSHM_SERVER_MEMORY_CONTROL_SEGMENT_H_
#define TENSORSHM_SERVER_MEMORY_CONTROL_SEGMENT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/unique_fd.h"
#include "common/shm/catalog_layout.h"
#include "server/memory/shm_segment.h"

namespace tensorshm {

// Thread-compatible: the catalog serialises access. Move-only; unlinks the segment when
// destroyed.
//
// The segment is shared memory another process of the daemon's uid can open read-write: its
// layout (record_count) is validated once, at Create or Open, and kept here; the daemon never
// trusts what it reads from the segment later (see Catalog).
class ControlSegment {
 public:
  // Creates "/<prefix>.ctl" (a memfd with SegmentBacking::kMemfd) with room for `record_count`
  // tensor records, mode 0600, and writes a fresh header. Errors as ShmSegment::Create.
  static absl::StatusOr<ControlSegment> Create(const std::string& prefix, uint32_t record_count,
                                               uint64_t host_pool_bytes,
                                               uint64_t host_segment_bytes,
                                               SegmentBacking backing = SegmentBacking::kNamed);

  // Re-opens "/<prefix>.ctl" left by a daemon that was killed (or stopped with
  // --keep-segments). FAILED_PRECONDITION naming the field if it is not a control segment of
  // this layout version; NOT_FOUND if there is none.
  static absl::StatusOr<ControlSegment> Open(const std::string& prefix);

  void Keep() { shm_.Keep(); }

  // A new read-only descriptor of the whole segment, for a client's fast path.
  absl::StatusOr<UniqueFd> OpenForClient() const { return shm_.OpenForClient(/*writable=*/false); }
  uint64_t size() const { return shm_.size(); }

  // The shared header, for storing into it (a later recovery reads it); nothing read from it
  // after Create / Open is trusted.
  ControlHeader& header() const { return *static_cast<ControlHeader*>(shm_.address()); }
  SegmentRecord& segment(uint32_t index) const;
  // REQUIRES: slot < record_count().
  TensorRecord& record(uint32_t slot) const;
  // The record count validated at Create / Open (not the header's word, which may have changed).
  uint32_t record_count() const { return record_count_; }

  // Writes every header word that no longer holds what Create wrote or Open found (another
  // process wrote it) back, with the two counters as given: later clients then map the segment
  // again, and a later recovery finds a header it accepts. Returns whether any word differed.
  bool RepairHeader(uint64_t next_tensor_id, uint64_t next_publish_seq) const;
  const std::string& name() const { return shm_.name(); }

 private:
  ControlSegment(ShmSegment shm, std::string prefix, uint32_t record_count,
                 uint64_t host_pool_bytes, uint64_t host_segment_bytes)
      : shm_(std::move(shm)),
        prefix_(std::move(prefix)),
        record_count_(record_count),
        host_pool_bytes_(host_pool_bytes),
        host_segment_bytes_(host_segment_bytes) {}
  ShmSegment shm_;
  std::string prefix_;
  uint32_t record_count_;
  uint64_t host_pool_bytes_;
  uint64_t host_segment_bytes_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_MEMORY_CONTROL_SEGMENT_H_
