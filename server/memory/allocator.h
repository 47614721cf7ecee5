// Best-fit allocation with coalescing over one segment's byte range. Lives in daemon memory only;
// it is rebuilt from the catalog, never trusted from shared memory.
#ifndef TENSORSHM_SERVER_MEMORY_ALLOCATOR_H_
#define TENSORSHM_SERVER_MEMORY_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace tensorshm {

// Thread-compatible.
class BestFitAllocator {
 public:
  // An allocator over [0, capacity), all of it free.
  explicit BestFitAllocator(uint64_t capacity);

  // Returns the offset of a block of `size` bytes taken from the smallest free block that holds
  // it (lowest offset among equals), or nullopt if none does. REQUIRES: size > 0.
  std::optional<uint64_t> Allocate(uint64_t size);

  // Size of the free block Allocate(size) would carve from, or nullopt; changes nothing.
  std::optional<uint64_t> BestFitBlock(uint64_t size) const;

  // Takes back [offset, offset + size), merging it with free neighbours.
  // REQUIRES: the range was returned by Allocate and is not free (checked; a violation aborts).
  void Free(uint64_t offset, uint64_t size);

  // Marks [offset, offset + size) used, as when rebuilding from the catalog. Returns false (and
  // changes nothing) if any of the range is not free.
  bool Reserve(uint64_t offset, uint64_t size);

  // The free block that ends the range: its size, 0 if the range's last byte is in use.
  uint64_t free_tail() const;
  // Gives up the free block that ends the range: the range (capacity()) ends where that block
  // began. Returns the bytes given up (free_tail()).
  uint64_t TrimTail();

  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free_block() const;
  size_t free_block_count() const { return by_offset_.size(); }

 private:
  void Insert(uint64_t offset, uint64_t size);
  void Erase(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t capacity_;
  uint64_t free_bytes_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;           // free blocks: offset -> size
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // free blocks: (size, offset)
};

// Index of the segment (anything with a BestFitAllocator `allocator` member) for which
// `eligible(segment)` holds with the smallest free block that holds `length` bytes, the first
// among equals; -1 if none does.
template <typename Segments, typename Eligible>
int BestFitSegment(const Segments& segments, uint64_t length, Eligible eligible) {
  int best = -1;
  uint64_t best_block = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    if (!eligible(segments[i])) continue;
    std::optional<uint64_t> block = segments[i].allocator.BestFitBlock(length);
    if (block && (best < 0 || *block < best_block)) {
      best = static_cast<int>(i);
      best_block = *block;
    }
  }
  return best;
}

template <typename Segments>
int BestFitSegment(const Segments& segments, uint64_t length) {
  return BestFitSegment(segments, length, [](const auto&) { return true; });
}

// How many of `buffers` (each with segment_id, offset and length), freed in their order, it takes
// for a block of `length` bytes to fit in one segment: that count, or -1 if freeing them all is
// not enough. `allocator_of(segment_id)` is a segment's allocator now: it is copied, never
// changed (an eviction's trial run).
template <typename Buffers, typename AllocatorOf>
int FreesToFitLength(uint64_t length, const Buffers& buffers, AllocatorOf allocator_of) {
  std::map<uint64_t, BestFitAllocator> trial;  // by segment id: copies, made as needed
  int freed = 0;
  for (const auto& buffer : buffers) {
    ++freed;
    auto it = trial.find(buffer.segment_id);
    if (it == trial.end()) {
      it = trial.emplace(buffer.segment_id, allocator_of(buffer.segment_id)).first;
    }
    it->second.Free(buffer.offset, buffer.length);
    if (it->second.BestFitBlock(length).has_value()) return freed;
  }
  return -1;
}

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_MEMORY_ALLOCATOR_H_
