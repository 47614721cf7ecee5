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
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/base/mapping.h"
#include "common/base/mutex.h"
#include "common/base/unique_fd.h"

namespace tensorshm {

// (segment_instance, segment_id), as a Location names a segment.
using SegmentKey = std::pair<uint64_t, uint64_t>;

// A read-only mapping of a whole segment, unmapped when the last holder (the map's cache, or
// an acquired tensor) lets it go.
class SegmentMapping {
 public:
  // Kept in sealed_ranges while it lives: a write to it says which tensor it hit.
  SegmentMapping(Mapping mapping, SegmentKey key, std::string shm_name);
  ~SegmentMapping();
  SegmentMapping(const SegmentMapping&) = delete;
  SegmentMapping& operator=(const SegmentMapping&) = delete;
  const char* address() const { return mapping_.data(); }
  uint64_t size() const { return mapping_.size(); }
  const SegmentKey& key() const { return key_; }
  // The object's POSIX shm name as the daemon granted it; empty for a memfd segment.
  const std::string& shm_name() const { return shm_name_; }
  // Maps every page of it (MADV_POPULATE_READ), so that no later read faults; takes time linear
  // in its pages (~100 ms for 256 MiB on a small VM). Failures only leave pages to fault in.
  void Populate() const;

 private:
  const Mapping mapping_;
  const SegmentKey key_;
  const std::string shm_name_;
};

// A read-write mapping of a whole host segment holding this process's uid's buffers, made once
// and kept while the segment lives (the map's cache, or a writable tensor, holds it), so that a
// buffer handed out again costs no mmap, munmap or page faults: pages stay in this process's page
// table once written or populated. Thread-safe.
//
// Sealing is an API promise, not a mapping property: no client API hands out a pointer into a
// published tensor's buffer; the producer's process keeps the whole segment mapped read-write (as
// it holds a read-write descriptor of it anyway). Bindings that keep views of a buffer past its
// publish make it read-only with Seal, until the buffer is handed out again.
class WritableSegment {
 public:
  // Kept in sealed_ranges while it lives: a write to a sealed buffer says which tensor it hit.
  // `fd`: the descriptor `mapping` was made from, kept open for read-only views (DupDescriptor).
  WritableSegment(Mapping mapping, SegmentKey key, std::string shm_name, UniqueFd fd);
  ~WritableSegment();
  WritableSegment(const WritableSegment&) = delete;
  WritableSegment& operator=(const WritableSegment&) = delete;
  char* address() const { return address_; }
  uint64_t size() const { return size_; }
  // As SegmentMapping's.
  const SegmentKey& key() const { return key_; }
  const std::string& shm_name() const { return shm_name_; }
  // A descriptor of the segment (close-on-exec), from which a read-only mapping of it is made
  // without asking the daemon again: leases on this process's own tensors (a put's) read
  // through such a mapping. Errors of fcntl name the segment.
  absl::StatusOr<UniqueFd> DupDescriptor() const;

  // Readies [offset, offset + length) for a new writable buffer: writable again if a sealed
  // buffer was there (its views are gone: the buffer was freed to be handed out again), and its
  // pages populated ahead of the producer's writes (MADV_POPULATE_WRITE, once per page for the
  // mapping's life). Returns the buffer's address. INVALID_ARGUMENT for a range outside the
  // segment; errors of mprotect name the segment. A kernel without MADV_POPULATE_WRITE leaves
  // pages to fault in on first write. `populate` false leaves the pages to a later Populate
  // (a stocked buffer, populated in the background).
  absl::StatusOr<char*> Prepare(uint64_t offset, uint64_t length, bool populate = true)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Populates the pages of [offset, offset + length) not populated yet (the range is inside the
  // segment, as a Prepare checked).
  void Populate(uint64_t offset, uint64_t length) ABSL_LOCKS_EXCLUDED(mu_);
  // Makes [offset, offset + length) read-only in this process (a write faults) until a Prepare
  // of a range that overlaps it. REQUIRES: the range was Prepared.
  absl::Status Seal(uint64_t offset, uint64_t length) ABSL_LOCKS_EXCLUDED(mu_);

  // Pages populated so far, for tests.
  uint64_t populated_pages() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void PopulateLocked(uint64_t offset, uint64_t length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Mapping mapping_;  // munmapped when the segment goes
  const UniqueFd fd_;      // closed when the segment goes
  char* const address_;
  const uint64_t size_;
  const SegmentKey key_;
  const std::string label_;
  const std::string shm_name_;
  mutable Mutex mu_;
  std::vector<bool> populated_ ABSL_GUARDED_BY(mu_);  // by page
  uint64_t populated_count_ ABSL_GUARDED_BY(mu_) = 0;
  bool can_populate_ ABSL_GUARDED_BY(mu_) = true;
  std::map<uint64_t, uint64_t> sealed_ ABSL_GUARDED_BY(mu_);  // offset -> length
};

// Read-only mappings and writable mappings of segments, each made once per segment and cached
// until Retain drops it or the map is destroyed. Thread-safe.
class SegmentMap {
 public:
  SegmentMap() = default;
  SegmentMap(const SegmentMap&) = delete;
  SegmentMap& operator=(const SegmentMap&) = delete;
  ~SegmentMap() = default;  // mappings go with their last holder

  // The cached mapping of `key`, or nullptr. FAILED_PRECONDITION if it is smaller than `size`
  // (the daemon's word for the segment's size).
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> Find(const SegmentKey& key,
                                                             uint64_t size) const;
  // Maps `fd` (read-only, the segment `key`, named `shm_name` or "" for a memfd; closed here
  // whatever happens) and caches it. If a
  // mapping of `key` was cached meanwhile, that one is returned. [offset, offset + length) of
  // the new mapping, the tensor wanted now, is populated (MADV_POPULATE_READ) before returning;
  // the rest is the caller's to populate (SegmentMapping::Populate) off its path.
  // FAILED_PRECONDITION if the object is smaller than `size`; other errors name the call and the
  // segment.
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> Insert(const SegmentKey& key, UniqueFd fd,
                                                               uint64_t size, std::string shm_name,
                                                               uint64_t offset = 0,
                                                               uint64_t length = 0);

  // The cached writable mapping of segment `key`, or nullptr if there is none.
  std::shared_ptr<WritableSegment> FindWritable(const SegmentKey& key) const;
  // Maps `fd` (read-write, `size` bytes of segment `key`, named `shm_name`; closed here whatever
  // happens) and caches it; if one was cached meanwhile, that one is returned. Errors name the
  // call and the segment.
  absl::StatusOr<std::shared_ptr<WritableSegment>> InsertWritable(const SegmentKey& key,
                                                                  UniqueFd fd, uint64_t size,
                                                                  std::string shm_name);

  // Forgets every segment not in `live` (a daemon that restarted serves other memory): its
  // mappings go once no tensor holds them. Returns how many read-only mappings it dropped.
  int Retain(const std::set<SegmentKey>& live);

  // Number of segments mapped read-only now.
  size_t size() const;
  // Whether segment `key` is mapped (read-only or writable) and not dropped by Retain: as far as
  // this client knows, its daemon still serves it.
  bool Holds(const SegmentKey& key) const;

 private:
  mutable Mutex mu_;
  std::map<SegmentKey, std::shared_ptr<const SegmentMapping>> mappings_ ABSL_GUARDED_BY(mu_);
  std::map<SegmentKey, std::shared_ptr<WritableSegment>> writable_ ABSL_GUARDED_BY(mu_);
};

// "segment 3 (instance 0x...)", for messages.
std::string SegmentLabel(const SegmentKey& key);

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_SEGMENT_MAP_H_
