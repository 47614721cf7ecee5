#include "server/memory/cuda_pool.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/sys_error.h"
#include "server/memory/pool_refusal.h"
#include "server/ops/log.h"

namespace tensorshm {

const char* CudaPoolKindName(CudaPoolKind kind) {
  switch (kind) {
    case CudaPoolKind::kAuto:
      return "auto";
    case CudaPoolKind::kVmm:
      return "vmm";
    case CudaPoolKind::kIpc:
      return "ipc";
  }
  return "?";
}

namespace {

uint64_t RoundUp(uint64_t n, uint64_t unit) { return (n + unit - 1) / unit * unit; }

// What cuMemCreate is given: device memory of `ordinal`, exportable as a POSIX descriptor.
CUmemAllocationProp VmmProperties(int ordinal) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

}  // namespace

absl::Status CudaPool::ChooseKind() {
  const int ordinal = options_.ordinal;
  int vmm = 0;
  int posix_fd = 0;
  if (absl::Status s = TSM_CU(driver_, ordinal, cuDeviceGetAttribute, &vmm,
                              CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_);
      !s.ok()) {
    return s;
  }
  if (vmm != 0) {
    if (absl::Status s =
            TSM_CU(driver_, ordinal, cuDeviceGetAttribute, &posix_fd,
                   CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device_);
        !s.ok()) {
      return s;
    }
  }
  const bool supported = vmm != 0 && posix_fd != 0;
  if (options_.kind == CudaPoolKind::kVmm && !supported) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda:", ordinal, ": --cuda-pool-kind vmm, but the driver (", driver_->library(),
        ") reports ", vmm != 0 ? "VMM without POSIX file descriptor handles" : "no VMM support",
        " for the device; use --cuda-pool-kind ipc"));
  }
  if (options_.kind == CudaPoolKind::kAuto) {
    options_.kind = supported ? CudaPoolKind::kVmm : CudaPoolKind::kIpc;
    // The daemon logs the kind with the pool; this says why auto fell back.
    if (!supported) {
      TSM_LOG(kInfo) << "cuda:" << ordinal
                     << ": legacy IPC pool: the driver reports no VMM with POSIX file descriptor "
                        "handles for the device";
    }
  }
  if (options_.kind == CudaPoolKind::kIpc) return absl::OkStatus();
  const CUmemAllocationProp prop = VmmProperties(ordinal);
  size_t granularity = 0;
  if (absl::Status s = TSM_CU(driver_, ordinal, cuMemGetAllocationGranularity, &granularity, &prop,
                              CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      !s.ok()) {
    return s;
  }
  if (granularity == 0 || granularity % kCudaAlignment != 0) {
    return absl::InternalError(absl::StrCat(
        "cuda:", ordinal, ": the driver reports a granularity of ", granularity, " bytes"));
  }
  granularity_ = granularity;
  return absl::OkStatus();
}

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
  if (absl::Status s = pool->ChooseKind(); !s.ok()) return s;
  if (pool->options_.kind == CudaPoolKind::kVmm) {
    const uint64_t unit = pool->granularity_;
    pool->options_.capacity_bytes = pool->options_.capacity_bytes / unit * unit;
    if (pool->options_.capacity_bytes == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda:", ordinal, " pool size = ", options.capacity_bytes,
                       ": smaller than the device's VMM granularity (", unit, " bytes)"));
    }
    pool->options_.segment_bytes =
        std::min(RoundUp(pool->options_.segment_bytes, unit), pool->options_.capacity_bytes);
  }
  if (absl::Status s = pool->AddSegment(pool->options_.segment_bytes); !s.ok()) return s;
  return pool;
}

CudaPool::~CudaPool() {
  if (context_ == nullptr) return;
  {
    ScopedContext scope(driver_, context_);
    for (const Segment& segment : segments_) FreeMemory(segment.memory);
  }
  driver_->cuDevicePrimaryCtxRelease_v2(device_);
}

void CudaPool::FreeMemory(const DeviceMemory& memory) const {
  if (options_.kind == CudaPoolKind::kVmm) {
    UniqueFd fd(memory.fd);  // closed on return
    if (absl::Status s = TSM_CU(driver_, options_.ordinal, cuMemRelease, memory.vmm); !s.ok()) {
      TSM_LOG(kWarning) << s.message();
    }
    return;
  }
  if (absl::Status s = TSM_CU(driver_, options_.ordinal, cuMemFree_v2, memory.base); !s.ok()) {
    TSM_LOG(kWarning) << s.message();
  }
}

absl::StatusOr<CudaPool::DeviceMemory> CudaPool::MakeSegment(const GrowthRequest& request) const {
  ScopedContext scope(driver_, context_);
  if (!scope.status().ok()) return scope.status();
  DeviceMemory memory;
  memory.size = request.size;
  if (options_.kind == CudaPoolKind::kVmm) {
    // Rounded up to whole granules; the capacity, and so what remains of it, is whole granules.
    memory.size = RoundUp(request.size, granularity_);
    const CUmemAllocationProp prop = VmmProperties(options_.ordinal);
    if (absl::Status s =
            TSM_CU(driver_, options_.ordinal, cuMemCreate, &memory.vmm, memory.size, &prop, 0);
        !s.ok()) {
      return s;
    }
    int fd = -1;
    if (absl::Status s = TSM_CU(driver_, options_.ordinal, cuMemExportToShareableHandle, &fd,
                                memory.vmm, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        !s.ok()) {
      driver_->cuMemRelease(memory.vmm);
      return s;
    }
    memory.fd = fd;
    return memory;
  }
  if (absl::Status s = TSM_CU(driver_, options_.ordinal, cuMemAlloc_v2, &memory.base, memory.size);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          TSM_CU(driver_, options_.ordinal, cuIpcGetMemHandle, &memory.handle, memory.base);
      !s.ok()) {
    driver_->cuMemFree_v2(memory.base);
    return s;
  }
  return memory;
}

absl::Status CudaPool::EndGrowth(const GrowthRequest& request, absl::StatusOr<DeviceMemory> made) {
  TSM_CHECK(growing_);
  growing_ = false;
  if (!made.ok()) return made.status();
  TSM_CHECK(request.segment_id == segments_.size() + 1);
  InstallSegment(*made);
  return absl::OkStatus();
}

absl::Status CudaPool::AddSegment(uint64_t size) {
  GrowthRequest request;
  request.segment_id = segments_.size() + 1;
  request.size = size;
  absl::StatusOr<DeviceMemory> memory = MakeSegment(request);
  if (!memory.ok()) return memory.status();
  InstallSegment(*memory);
  return absl::OkStatus();
}

void CudaPool::InstallSegment(const DeviceMemory& memory) {
  segments_.push_back(Segment{memory, BestFitAllocator(memory.size)});
  reserved_bytes_ += memory.size;
  TSM_LOG(kInfo) << "cuda:" << options_.ordinal << " (" << FormatUuid(uuid_) << "): segment "
                 << segments_.size() << " of " << memory.size << " bytes";
}

int CudaPool::FreesToFit(uint64_t nbytes, absl::Span<const Buffer> buffers) const {
  const uint64_t length = (nbytes + kCudaAlignment - 1) / kCudaAlignment * kCudaAlignment;
  for (const Buffer& buffer : buffers) {
    TSM_CHECK(buffer.segment_id >= 1 && buffer.segment_id <= segments_.size());
  }
  return FreesToFitLength(length, buffers, [this](uint64_t segment_id) -> const BestFitAllocator& {
    return segments_[segment_id - 1].allocator;
  });
}

absl::StatusOr<Buffer> CudaPool::Allocate(uint64_t nbytes, GrowthRequest* growth) {
  TSM_CHECK(nbytes > 0);
  const uint64_t length = (nbytes + kCudaAlignment - 1) / kCudaAlignment * kCudaAlignment;
  int index = BestFitSegment(segments_, length);
  if (index < 0) {
    const uint64_t remaining = options_.capacity_bytes - reserved_bytes_;
    if (length > options_.capacity_bytes) {
      return NeverFitsError(absl::StrCat("cuda:", options_.ordinal, " pool: cannot allocate ",
                                         nbytes, " bytes: larger than the whole pool (",
                                         options_.capacity_bytes, " bytes, --cuda-pool)"));
    }
    if (remaining < length) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda:", options_.ordinal, " pool: cannot allocate ", nbytes,
                       " bytes: ", options_.capacity_bytes - used_bytes(), " of ",
                       options_.capacity_bytes, " bytes free (--cuda-pool)"));
    }
    const uint64_t size =
        std::min(RoundUp(std::max(options_.segment_bytes, length), granularity_), remaining);
    if (growth != nullptr) {
      if (growing_) {
        growth->busy = true;
      } else {
        growth->needed = true;
        growth->segment_id = segments_.size() + 1;
        growth->size = size;
      }
      return absl::UnavailableError(
          absl::StrCat("cuda:", options_.ordinal, " pool: a new segment must be made first"));
    }
    TSM_CHECK(!growing_);
    if (absl::Status s = AddSegment(size); !s.ok()) return s;
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
  return segments_[segment_id - 1].memory.handle;
}

absl::StatusOr<UniqueFd> CudaPool::SegmentDescriptor(uint64_t segment_id) const {
  if (options_.kind != CudaPoolKind::kVmm) {
    return absl::FailedPreconditionError(
        absl::StrCat("segment.cuda: cuda:", options_.ordinal,
                     " is a legacy IPC pool (--cuda-pool-kind ipc); its segments are opened by "
                     "their IPC handle"));
  }
  if (!HasSegment(segment_id)) {
    return absl::NotFoundError(absl::StrCat("segment.segment_id = ", segment_id,
                                            ": no such segment in the cuda:", options_.ordinal,
                                            " pool (", segments_.size(), " segments)"));
  }
  const int fd = fcntl(segments_[segment_id - 1].memory.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    return ErrnoError("fcntl(F_DUPFD_CLOEXEC)",
                      absl::StrCat("cuda:", options_.ordinal, " segment ", segment_id), errno);
  }
  return UniqueFd(fd);
}

uint64_t CudaPool::SegmentSize(uint64_t segment_id) const {
  TSM_CHECK(segment_id >= 1 && segment_id <= segments_.size());
  return segments_[segment_id - 1].memory.size;
}

uint64_t CudaPool::largest_free_bytes() const {
  uint64_t largest = options_.capacity_bytes - reserved_bytes_;
  for (const Segment& s : segments_) largest = std::max(largest, s.allocator.largest_free_block());
  return largest;
}

uint64_t CudaPool::used_bytes() const {
  uint64_t used = 0;
  for (const Segment& s : segments_) used += s.allocator.capacity() - s.allocator.free_bytes();
  return used;
}

}  // namespace tensorshm
