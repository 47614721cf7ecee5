#include "server/cuda_pool.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "server/log.h"

namespace tensorshm {

absl::StatusOr<std::unique_ptr<CudaPool>> CudaPool::Create(const CudaDriver* driver,
                                                           const CudaPoolOptions& options) {
  const int ordinal = options.ordinal;
  absl::StatusOr<int> count = driver->DeviceCount();
  if (!count.ok()) return count.status();
  if (ordinal < 0 || ordinal >= *count) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", ordinal, ": no such device; the driver (", driver->library(),
                     ") sees ", *count, " device", *count == 1 ? "" : "s"));
  }
  if (options.capacity_bytes == 0 || options.capacity_bytes % kCudaAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda:", ordinal,
                                                   " pool size = ", options.capacity_bytes,
                                                   ": must be a positive multiple of 256 bytes"));
  }
  std::unique_ptr<CudaPool> pool(new CudaPool(driver, options));
  if (pool->options_.segment_bytes == 0 || pool->options_.segment_bytes > options.capacity_bytes) {
    pool->options_.segment_bytes = options.capacity_bytes;
  }
  pool->options_.segment_bytes =
      (pool->options_.segment_bytes + kCudaAlignment - 1) / kCudaAlignment * kCudaAlignment;
  if (absl::Status s = TSM_CU(driver, ordinal, cuDeviceGet, &pool->device_, ordinal); !s.ok()) {
    return s;
  }
  absl::StatusOr<DeviceUuid> uuid = driver->Uuid(ordinal);
  if (!uuid.ok()) return uuid.status();
  pool->uuid_ = *uuid;
  if (absl::Status s =
          TSM_CU(driver, ordinal, cuDevicePrimaryCtxRetain, &pool->context_, pool->device_);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = pool->AddSegment(pool->options_.segment_bytes); !s.ok()) return s;
  return pool;
}

CudaPool::~CudaPool() {
  if (context_ == nullptr) return;
  {
    ScopedContext scope(driver_, context_);
    for (const Segment& segment : segments_) {
      if (absl::Status s = TSM_CU(driver_, options_.ordinal, cuMemFree_v2, segment.base); !s.ok()) {
        TSM_LOG(kWarning) << s.message();
      }
    }
  }
  driver_->cuDevicePrimaryCtxRelease_v2(device_);
}

absl::Status CudaPool::AddSegment(uint64_t size) {
  ScopedContext scope(driver_, context_);
  if (!scope.status().ok()) return scope.status();
  Segment segment{0, size, {}, BestFitAllocator(size)};
  if (absl::Status s = TSM_CU(driver_, options_.ordinal, cuMemAlloc_v2, &segment.base, size);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          TSM_CU(driver_, options_.ordinal, cuIpcGetMemHandle, &segment.handle, segment.base);
      !s.ok()) {
    driver_->cuMemFree_v2(segment.base);
    return s;
  }
  segments_.push_back(std::move(segment));
  reserved_bytes_ += size;
  TSM_LOG(kInfo) << "cuda:" << options_.ordinal << " (" << FormatUuid(uuid_) << "): segment "
                 << segments_.size() << " of " << size << " bytes";
  return absl::OkStatus();
}

absl::StatusOr<Buffer> CudaPool::Allocate(uint64_t nbytes) {
  TSM_CHECK(nbytes > 0);
  const uint64_t length = (nbytes + kCudaAlignment - 1) / kCudaAlignment * kCudaAlignment;
  int index = BestFitSegment(segments_, length);
  if (index < 0) {
    const uint64_t remaining = options_.capacity_bytes - reserved_bytes_;
    if (remaining < length) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda:", options_.ordinal, " pool: cannot allocate ", nbytes,
                       " bytes: ", options_.capacity_bytes - used_bytes(), " of ",
                       options_.capacity_bytes, " bytes free (--cuda-pool)"));
    }
    if (absl::Status s = AddSegment(std::min(std::max(options_.segment_bytes, length), remaining));
        !s.ok()) {
      return s;
    }
    index = static_cast<int>(segments_.size()) - 1;
  }
  std::optional<uint64_t> offset = segments_[index].allocator.Allocate(length);
  TSM_CHECK(offset.has_value());
  return Buffer{static_cast<uint64_t>(index) + 1, *offset, length};
}

void CudaPool::Free(const Buffer& buffer) {
  TSM_CHECK(buffer.segment_id >= 1 && buffer.segment_id <= segments_.size());
  segments_[buffer.segment_id - 1].allocator.Free(buffer.offset, buffer.length);
}

const CUipcMemHandle& CudaPool::SegmentHandle(uint64_t segment_id) const {
  TSM_CHECK(segment_id >= 1 && segment_id <= segments_.size());
  return segments_[segment_id - 1].handle;
}

uint64_t CudaPool::SegmentSize(uint64_t segment_id) const {
  TSM_CHECK(segment_id >= 1 && segment_id <= segments_.size());
  return segments_[segment_id - 1].size;
}

uint64_t CudaPool::used_bytes() const {
  uint64_t used = 0;
  for (const Segment& s : segments_) used += s.allocator.capacity() - s.allocator.free_bytes();
  return used;
}

}  // namespace tensorshm
