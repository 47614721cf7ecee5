#include "server/memory/allocator.h"

#include <iterator>

#include "common/base/check.h"

namespace tensorshm {

BestFitAllocator::BestFitAllocator(uint64_t capacity) : capacity_(capacity) {
  if (capacity > 0) Insert(0, capacity);
}

void BestFitAllocator::Insert(uint64_t offset, uint64_t size) {
  by_offset_.emplace(offset, size);
  by_size_.emplace(size, offset);
  free_bytes_ += size;
}

void BestFitAllocator::Erase(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  by_offset_.erase(it);
}

std::optional<uint64_t> BestFitAllocator::BestFitBlock(uint64_t size) const {
  auto it = by_size_.lower_bound({size, 0});
  if (it == by_size_.end()) return std::nullopt;
  return it->first;
}

std::optional<uint64_t> BestFitAllocator::Allocate(uint64_t size) {
  TSM_CHECK(size > 0);
  auto fit = by_size_.lower_bound({size, 0});
  if (fit == by_size_.end()) return std::nullopt;
  const uint64_t block_offset = fit->second;
  const uint64_t block_size = fit->first;
  Erase(by_offset_.find(block_offset));
  if (block_size > size) Insert(block_offset + size, block_size - size);
  return block_offset;
}

void BestFitAllocator::Free(uint64_t offset, uint64_t size) {
  TSM_CHECK(size > 0 && offset <= capacity_ && size <= capacity_ - offset);
  auto next = by_offset_.lower_bound(offset);
  // The freed range must not overlap the free block after it...
  TSM_CHECK(next == by_offset_.end() || offset + size <= next->first);
  uint64_t start = offset;
  uint64_t end = offset + size;
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    // ... nor the one before it (a double free).
    TSM_CHECK(prev->first + prev->second <= offset);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      Erase(prev);
    }
  }
  if (next != by_offset_.end() && next->first == end) {
    end += next->second;
    Erase(next);
  }
  Insert(start, end - start);
}

bool BestFitAllocator::Reserve(uint64_t offset, uint64_t size) {
  if (size == 0 || offset > capacity_ || size > capacity_ - offset) return false;
  auto it = by_offset_.upper_bound(offset);
  if (it == by_offset_.begin()) return false;
  --it;
  const uint64_t block_offset = it->first;
  const uint64_t block_end = it->first + it->second;
  if (offset + size > block_end) return false;
  Erase(it);
  if (block_offset < offset) Insert(block_offset, offset - block_offset);
  if (offset + size < block_end) Insert(offset + size, block_end - offset - size);
  return true;
}

uint64_t BestFitAllocator::free_tail() const {
  if (by_offset_.empty()) return 0;
  const auto last = std::prev(by_offset_.end());
  return last->first + last->second == capacity_ ? last->second : 0;
}

uint64_t BestFitAllocator::TrimTail() {
  const uint64_t tail = free_tail();
  if (tail == 0) return 0;
  Erase(std::prev(by_offset_.end()));
  capacity_ -= tail;
  return tail;
}

uint64_t BestFitAllocator::largest_free_block() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

}  // namespace tensorshm
