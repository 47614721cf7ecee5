// The control segment holding the catalog records (see common/catalog_layout.h).
#ifndef TENSORSHM_SERVER_CONTROL_SEGMENT_H_
#define TENSORSHM_SERVER_CONTROL_SEGMENT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/catalog_layout.h"
#include "server/shm_segment.h"

namespace tensorshm {

// Thread-compatible: the catalog serialises access. Move-only; unlinks the segment when
// destroyed.
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

  // A read-only descriptor of the whole segment for a client's fast path (the caller closes it).
  absl::StatusOr<int> OpenForClient() const { return shm_.OpenForClient(/*writable=*/false); }
  uint64_t size() const { return shm_.size(); }

  ControlHeader& header() const { return *static_cast<ControlHeader*>(shm_.address()); }
  SegmentRecord& segment(uint32_t index) const;
  TensorRecord& record(uint32_t slot) const;
  uint32_t record_count() const { return header().record_count; }
  const std::string& name() const { return shm_.name(); }

 private:
  explicit ControlSegment(ShmSegment shm) : shm_(std::move(shm)) {}
  ShmSegment shm_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CONTROL_SEGMENT_H_
