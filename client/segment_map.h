// A client's mappings of the daemon's host segments, keyed by (segment_instance, segment_id):
// the memory object itself, never its name, which a restarted daemon may give to a new object.
#ifndef TENSORSHM_CLIENT_SEGMENT_MAP_H_
#define TENSORSHM_CLIENT_SEGMENT_MAP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"

namespace tensorshm {

// (segment_instance, segment_id), as a Location names a segment.
using SegmentKey = std::pair<uint64_t, uint64_t>;

// A read-only mapping of a whole segment, unmapped when the last holder (the map's cache, or
// an acquired tensor) lets it go.
class SegmentMapping {
 public:
  SegmentMapping(const char* address, uint64_t size) : address_(address), size_(size) {}
  ~SegmentMapping();
  SegmentMapping(const SegmentMapping&) = delete;
  SegmentMapping& operator=(const SegmentMapping&) = delete;
  const char* address() const { return address_; }
  uint64_t size() const { return size_; }

 private:
  const char* address_;
  uint64_t size_;
};

// Read-only mappings and writable descriptors of segments, each made once per segment and
// cached until Retain drops it or the map is destroyed. Thread-safe.
class SegmentMap {
 public:
  SegmentMap() = default;
  SegmentMap(const SegmentMap&) = delete;
  SegmentMap& operator=(const SegmentMap&) = delete;
  ~SegmentMap();  // closes the descriptors; mappings go with their last holder

  // The cached mapping of `key`, or nullptr. FAILED_PRECONDITION if it is smaller than `size`
  // (the daemon's word for the segment's size).
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> Find(const SegmentKey& key,
                                                             uint64_t size) const;
  // Maps `fd` (read-only, the segment `key`; closed here whatever happens) and caches it. If a
  // mapping of `key` was cached meanwhile, that one is returned. FAILED_PRECONDITION if the
  // object is smaller than `size`; other errors name the call and the segment.
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> Insert(const SegmentKey& key, int fd,
                                                               uint64_t size);

  // Maps [offset, offset + length) of segment `key` read-write through its cached writable
  // descriptor: a producer's own buffer and nothing else. NOT_FOUND if no descriptor of `key` is
  // cached; other errors name the call and the segment. REQUIRES: offset page-aligned. The
  // caller munmaps the result.
  absl::StatusOr<void*> MapWritableRange(const SegmentKey& key, uint64_t offset,
                                         uint64_t length) const;
  // Caches `fd` as the writable descriptor of `key` (unless one is cached already, in which case
  // `fd` is closed).
  void InsertWritable(const SegmentKey& key, int fd);

  // Forgets every segment not in `live` (a daemon that restarted serves other memory): its
  // descriptor is closed, and its mapping goes once no tensor holds it. Returns how many.
  int Retain(const std::set<SegmentKey>& live);

  // Number of segments mapped read-only now.
  size_t size() const;

 private:
  mutable Mutex mu_;
  std::map<SegmentKey, std::shared_ptr<const SegmentMapping>> mappings_ ABSL_GUARDED_BY(mu_);
  std::map<SegmentKey, int> writable_ ABSL_GUARDED_BY(mu_);
};

// "segment 3 (instance 0x...)", for messages.
std::string SegmentLabel(const SegmentKey& key);

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_SEGMENT_MAP_H_
