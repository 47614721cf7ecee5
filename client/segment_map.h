// Mappings of the daemon's shm segments into a client process.
#ifndef TENSORSHM_CLIENT_SEGMENT_MAP_H_
#define TENSORSHM_CLIENT_SEGMENT_MAP_H_

#include <cstdint>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"

namespace tensorshm {

// Read-only mappings of whole segments, each made once and kept until the map is destroyed.
// Thread-safe.
class SegmentMap {
 public:
  SegmentMap() = default;
  SegmentMap(const SegmentMap&) = delete;
  SegmentMap& operator=(const SegmentMap&) = delete;
  ~SegmentMap();  // unmaps every segment

  // Returns the base address of shm object `shm_name` mapped read-only, mapping it on first use.
  // `size` is the segment size the daemon reports; a smaller object is refused with
  // FAILED_PRECONDITION. Other errors name the call and the object.
  absl::StatusOr<const char*> MapReadOnly(const std::string& shm_name, uint64_t size);

  // Number of segments mapped so far.
  size_t size() const;

 private:
  struct Mapping {
    void* address;
    uint64_t size;
  };
  mutable Mutex mu_;
  std::unordered_map<std::string, Mapping> mappings_ ABSL_GUARDED_BY(mu_);
};

// Maps [offset, offset + length) of shm object `shm_name` read-write: a producer's own buffer and
// nothing else. REQUIRES: offset page-aligned. The caller munmaps the result.
absl::StatusOr<void*> MapWritable(const std::string& shm_name, uint64_t offset, uint64_t length);

// Checks that `shm_name` is a plain POSIX shm name ("/name" with no further '/').
absl::Status ValidateShmName(const std::string& shm_name);

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_SEGMENT_MAP_H_
