#include "client/stock_shelf.h"

#include <algorithm>
#include <utility>

namespace tensorshm {
namespace {

// Stocked buffers (CreateRequest.stock): per buffer length, the client asks for enough to hold
// kStockTargetBytes (between 1 and kMaxStockPerLength buffers), for lengths up to
// kMaxStockedLength, and holds at most kMaxStockBytes in all.
// A length is stocked once this client created kStockAfterCreates tensors of it: a
// producer in a loop, not a one-off.
constexpr uint64_t kStockAfterCreates = 8;
constexpr uint64_t kStockTargetBytes = 2 << 20;
constexpr uint64_t kMaxStockPerLength = 16;
constexpr uint64_t kMaxStockedLength = 4 << 20;
constexpr uint64_t kMaxStockBytes = 16 << 20;

}  // namespace

std::optional<StockShelf::Stocked> StockShelf::Take(uint64_t length) {
  MutexLock lock(&mu_);
  auto it = shelf_.find(length);
  if (it == shelf_.end() || it->second.empty()) return std::nullopt;
  Stocked buffer = it->second.back();
  it->second.pop_back();
  bytes_ -= length;
  return buffer;
}

uint32_t StockShelf::Wanted(uint64_t length) const {
  if (length == 0 || length > kMaxStockedLength) return 0;
  const uint64_t target = std::clamp<uint64_t>(kStockTargetBytes / length, 1, kMaxStockPerLength);
  MutexLock lock(&mu_);
  auto created = creates_.find(length);
  if (created == creates_.end() || created->second < kStockAfterCreates) return 0;
  auto it = shelf_.find(length);
  const uint64_t have = it == shelf_.end() ? 0 : it->second.size();
  // Refilled ahead of need: when half is gone.
  if (have * 2 > target || bytes_ + (target - have) * length > kMaxStockBytes) return 0;
  return static_cast<uint32_t>(target - have);
}

void StockShelf::NoteCreate(uint64_t length) {
  MutexLock lock(&mu_);
  ++creates_[length];
}

void StockShelf::Put(Stocked stocked) {
  MutexLock lock(&mu_);
  const uint64_t length = stocked.location.length();
  shelf_[length].push_back(std::move(stocked));
  bytes_ += length;
}

void StockShelf::Drop() {
  MutexLock lock(&mu_);
  shelf_.clear();
  bytes_ = 0;
}

}  // namespace tensorshm
