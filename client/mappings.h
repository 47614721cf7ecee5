// Mappings: this client's views of the daemon's memory, each made on first use from a descriptor
// the memory channel brings, and kept: read-only mappings of host segments (every acquired
// tensor's), writable ones of the segments of its own buffers, and VMM CUDA segments.
#ifndef TENSORSHM_CLIENT_MAPPINGS_H_
#define TENSORSHM_CLIENT_MAPPINGS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/cuda_state.h"
#include "client/memory_channel.h"
#include "client/segment_map.h"
#include "common/base/unique_fd.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

// A buffer of this session's own (a create's, or stock) in the writable mapping of its segment;
// `segment` keeps the mapping alive.
struct HostBuffer {
  std::shared_ptr<WritableSegment> segment;
  char* data = nullptr;
};

// Thread-safe (each map has its lock; the memory channel serialises its requests).
class Mappings {
 public:
  // All outlive it. `session_token()` names the current session in the channel's requests;
  // `populate_later(work)` queues `work` (populating pages) for a background thread.
  Mappings(MemoryChannel& channel, std::function<std::string()> session_token,
           std::function<void(std::function<void()>)> populate_later)
      : channel_(channel),
        session_token_(std::move(session_token)),
        populate_later_(std::move(populate_later)) {}
  Mappings(const Mappings&) = delete;
  Mappings& operator=(const Mappings&) = delete;

  // The read-only mapping of the whole host segment `key` (as many bytes as the daemon grants),
  // shared by every tensor in it. An error if the segment is smaller than `size` bytes. A new
  // mapping is populated: the tensor at [offset, offset + length) at once, the rest in the
  // background (SegmentMap::Insert).
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> HostSegment(const SegmentKey& key,
                                                                    uint64_t size, uint64_t offset,
                                                                    uint64_t length);
  // The base address, in this process's device `ordinal`, of the VMM CUDA segment `location`
  // names, mapped read-only (CudaState::MapVmmSegment).
  absl::StatusOr<CUdeviceptr> CudaSegment(int ordinal, const v1::Location& location);
  // `location`'s buffer (this session's own) in the writable mapping of its segment, readied
  // for writing (WritableSegment::Prepare). `populate` false: the pages are left for
  // WritableSegment::Populate.
  absl::StatusOr<HostBuffer> Buffer(const v1::Location& location, bool populate = true);
  // Maps the writable segment `grant` names from `fd` (as Buffer does with a descriptor it asked
  // for), unless it is mapped already. A failure is not reported: the next Buffer in the
  // segment asks the daemon, and hears why.
  void AdoptWritable(const v1::SegmentGrant& grant, UniqueFd fd);

  SegmentMap& segments() { return segments_; }
  CudaState& cuda() { return cuda_; }

 private:
  MemoryChannel& channel_;
  const std::function<std::string()> session_token_;
  const std::function<void(std::function<void()>)> populate_later_;
  SegmentMap segments_;
  CudaState cuda_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_MAPPINGS_H_
