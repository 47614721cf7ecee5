// ClientCore's stock (buffers the daemon made ahead of need) and its mappings of host segments.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/client_core.h"

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

std::optional<ClientCore::StockedBuffer> ClientCore::TakeStock(uint64_t length) {
  MutexLock lock(&stock_mu_);
  auto it = stock_.find(length);
  if (it == stock_.end() || it->second.empty()) return std::nullopt;
  StockedBuffer buffer = it->second.back();
  it->second.pop_back();
  stock_bytes_ -= length;
  return buffer;
}

uint32_t ClientCore::StockWanted(uint64_t length) const {
  if (length == 0 || length > kMaxStockedLength) return 0;
  const uint64_t target = std::clamp<uint64_t>(kStockTargetBytes / length, 1, kMaxStockPerLength);
  MutexLock lock(&stock_mu_);
  auto created = creates_.find(length);
  if (created == creates_.end() || created->second < kStockAfterCreates) return 0;
  auto it = stock_.find(length);
  const uint64_t have = it == stock_.end() ? 0 : it->second.size();
  // Refilled ahead of need: when half is gone.
  if (have * 2 > target || stock_bytes_ + (target - have) * length > kMaxStockBytes) return 0;
  return static_cast<uint32_t>(target - have);
}

void ClientCore::AddStock(const google::protobuf::RepeatedPtrField<v1::StockedBuffer>& stocked) {
  for (const v1::StockedBuffer& buffer : stocked) {
    // Populated on the sender thread: the publish or create that brought the stock does not
    // wait for it (CreateOnce populates whatever is left when it takes the buffer).
    absl::StatusOr<HostBuffer> mapped = MapHostBuffer(buffer.location(), /*populate=*/false);
    if (!mapped.ok()) continue;
    {
      MutexLock lock(&mu_);
      to_populate_.push_back(
          [segment = mapped->segment, offset = buffer.location().offset(),
           length = buffer.location().length()] { segment->Populate(offset, length); });
      work_.Signal();
    }
    MutexLock lock(&stock_mu_);
    stock_[buffer.location().length()].push_back(
        StockedBuffer{buffer.tensor_id(), *std::move(mapped), buffer.location()});
    stock_bytes_ += buffer.location().length();
  }
}

void ClientCore::ExpectFill(uint64_t length) {
  // A fill at a conservative 4 GB/s (a single-threaded copy from cold memory), plus what the
  // caller does around it; the daemon bounds the wait to 1 ms anyway.
  constexpr uint64_t kBytesPerMicro = 4096;
  constexpr uint64_t kAround = 100;
  memory_.Expect(session_id(), static_cast<uint32_t>(
                                   std::min<uint64_t>(length / kBytesPerMicro + kAround, 1000)));
}

void ClientCore::DropStock() {
  MutexLock lock(&stock_mu_);
  stock_.clear();
  stock_bytes_ = 0;
}

absl::StatusOr<std::shared_ptr<const SegmentMapping>> ClientCore::MapHostSegment(
    const SegmentKey& key, uint64_t segment_size, uint64_t offset, uint64_t length) {
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> found = segments_.Find(key, segment_size);
  if (!found.ok() || *found != nullptr) return found;
  uint64_t size = 0;
  std::string shm_name;
  absl::StatusOr<UniqueFd> fd;
  if (std::shared_ptr<WritableSegment> own = segments_.FindWritable(key)) {
    // A segment of this process's own buffers (a put's lease): viewed read-only through the
    // descriptor it already holds, without asking the daemon.
    fd = own->DupDescriptor();
    size = own->size();
    shm_name = own->shm_name();
  } else {
    fd = memory_.RequestSegment(session_id(), key.first, key.second, /*writable=*/false, &size,
                                &shm_name);
  }
  if (!fd.ok()) return fd.status();
  if (size < segment_size) {
    return absl::InternalError(absl::StrCat("tensorshmd granted ", SegmentLabel(key), " as ", size,
                                            " bytes; its location said ", segment_size));
  }
  // The whole segment, as the daemon granted it (at least what the caller needs).
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping =
      segments_.Insert(key, *std::move(fd), size, std::move(shm_name), offset, length);
  if (mapping.ok() && (*mapping)->size() > length) {
    // The rest of the segment on the sender thread: a small first tensor does not wait for a
    // large segment, and later reads of it do not fault.
    MutexLock lock(&mu_);
    to_populate_.push_back([mapping = *mapping] { mapping->Populate(); });
    work_.Signal();
  }
  return mapping;
}

absl::StatusOr<CUdeviceptr> ClientCore::MapCudaSegment(int ordinal, const v1::Location& location) {
  const SegmentKey key{location.segment_instance(), location.segment_id()};
  if (CudaState::Mapped mapped; cuda_.FindMapped(ordinal, key, &mapped)) return mapped.base;
  uint64_t size = 0;
  uint64_t granularity = 0;
  absl::StatusOr<UniqueFd> fd = memory_.RequestCudaSegment(
      session_id(), location.cuda().device_ordinal(), key.first, key.second, &size, &granularity);
  if (!fd.ok()) return fd.status();
  if (size < location.segment_size()) {
    return absl::InternalError(absl::StrCat("tensorshmd granted cuda segment ", key.second, " as ",
                                            size, " bytes; its location said ",
                                            location.segment_size()));
  }
  return cuda_.MapVmmSegment(ordinal, key, *std::move(fd), size, granularity);
}

void ClientCore::AdoptWritableSegment(const v1::SegmentGrant& grant, UniqueFd fd) {
  const SegmentKey key{grant.segment_instance(), grant.segment_id()};
  if (!grant.writable() || segments_.FindWritable(key) != nullptr) return;
  (void)segments_.InsertWritable(key, std::move(fd), grant.size(), grant.shm_name());
}

absl::StatusOr<ClientCore::HostBuffer> ClientCore::MapHostBuffer(const v1::Location& location,
                                                                 bool populate) {
  const SegmentKey key{location.segment_instance(), location.segment_id()};
  std::shared_ptr<WritableSegment> segment = segments_.FindWritable(key);
  if (segment == nullptr) {
    uint64_t size = 0;
    std::string shm_name;
    absl::StatusOr<UniqueFd> fd = memory_.RequestSegment(session_id(), key.first, key.second,
                                                         /*writable=*/true, &size, &shm_name);
    if (!fd.ok()) return fd.status();
    absl::StatusOr<std::shared_ptr<WritableSegment>> inserted =
        segments_.InsertWritable(key, *std::move(fd), size, std::move(shm_name));
    if (!inserted.ok()) return inserted.status();
    segment = *std::move(inserted);
  }
  absl::StatusOr<char*> data = segment->Prepare(location.offset(), location.length(), populate);
  if (!data.ok()) return data.status();
  return HostBuffer{std::move(segment), *data};
}

}  // namespace tensorshm
