// A CUDA device pool: segments sub-allocated best-fit in 256-byte units, of one of two kinds.
// VMM segments are cuMemCreate allocations exported as POSIX file descriptors, which clients get
// over the memory channel and map read-only (a producer makes its own buffers' granules writable
// until their publish). Legacy segments come from cuMemAlloc in the device's primary context, each
// exported with one IPC handle, which any holder opens read-write (what Triton's CUDA shared
// memory registers).
#ifndef TENSORSHM_SERVER_MEMORY_CUDA_POOL_H_
#define TENSORSHM_SERVER_MEMORY_CUDA_POOL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/base/unique_fd.h"
#include "common/cuda/cuda_driver.h"
#include "server/memory/allocator.h"
#include "server/memory/host_pool.h"

namespace tensorshm {

// Alignment and size unit of device buffers (what cudaMalloc guarantees, and enough for every
// DLPack dtype).
inline constexpr uint64_t kCudaAlignment = 256;

enum class CudaPoolKind {
  kAuto,  // kVmm where the driver reports VMM with POSIX file descriptor handles, else kIpc
  kVmm,
  kIpc,
};
// "auto", "vmm" or "ipc".
const char* CudaPoolKindName(CudaPoolKind kind);

struct CudaPoolOptions {
  int ordinal = 0;
  CudaPoolKind kind = CudaPoolKind::kAuto;
  uint64_t capacity_bytes = 0;
  uint64_t segment_bytes = 0;  // 0: one segment of the whole capacity
};

// Thread-compatible: the catalog serialises access.
class CudaPool {
 public:
  // Retains device `ordinal`'s primary context and allocates the first segment. Errors name the
  // device: FAILED_PRECONDITION if it does not exist (or kVmm is asked of a device or driver
  // without VMM and POSIX file descriptor handles), the driver's error otherwise. kAuto is
  // resolved here (kind() says to what). VMM pools round the segment size up, and the capacity
  // down, to the device's granularity.
  static absl::StatusOr<std::unique_ptr<CudaPool>> Create(const CudaDriver* driver,
                                                          const CudaPoolOptions& options);
  ~CudaPool();

  // A buffer of at least `nbytes` (rounded up to 256 bytes), best fit over the segments, growing
  // by a segment while the capacity allows. RESOURCE_EXHAUSTED naming requested and free bytes.
  // With `growth`, a new segment is not made here: UNAVAILABLE, with `*growth` saying which
  // (as HostPool::Allocate). REQUIRES (without `growth`): no growth under way.
  absl::StatusOr<Buffer> Allocate(uint64_t nbytes, GrowthRequest* growth = nullptr);
  void Free(const Buffer& buffer);
  // How many of `buffers` (allocated here), freed in order, make Allocate(nbytes) fit in a
  // segment made so far: the fewest that do, or -1 (as HostPool::FreesToFit).
  int FreesToFit(uint64_t nbytes, absl::Span<const Buffer> buffers) const;

  // Device memory of one segment: a legacy allocation with its IPC handle, or a VMM allocation
  // with its exported descriptor (owned by the pool once installed).
  struct DeviceMemory {
    CUdeviceptr base = 0;  // legacy
    uint64_t size = 0;
    CUipcMemHandle handle{};               // legacy
    CUmemGenericAllocationHandle vmm = 0;  // VMM
    int fd = -1;                           // VMM
  };
  // Growing the pool outside the caller's lock, as HostPool's: MakeSegment (cuMemAlloc and the
  // IPC handle) reads only what the pool fixed at its creation.
  void BeginGrowth() { growing_ = true; }
  absl::StatusOr<DeviceMemory> MakeSegment(const GrowthRequest& request) const;
  absl::Status EndGrowth(const GrowthRequest& request, absl::StatusOr<DeviceMemory> made);

  int ordinal() const { return options_.ordinal; }
  CudaPoolKind kind() const { return options_.kind; }    // kVmm or kIpc
  uint64_t granularity() const { return granularity_; }  // VMM: the device's; legacy: 256
  const DeviceUuid& uuid() const { return uuid_; }
  // The IPC handle (legacy) and size of segment `segment_id` (1-based). REQUIRES: a live segment
  // id.
  const CUipcMemHandle& SegmentHandle(uint64_t segment_id) const;
  // A new descriptor (close-on-exec) of VMM segment `segment_id`, for a client. NOT_FOUND for an
  // id no segment has, FAILED_PRECONDITION on a legacy pool.
  absl::StatusOr<UniqueFd> SegmentDescriptor(uint64_t segment_id) const;
  bool HasSegment(uint64_t segment_id) const {
    return segment_id >= 1 && segment_id <= segments_.size();
  }
  uint64_t SegmentSize(uint64_t segment_id) const;
  uint64_t capacity_bytes() const { return options_.capacity_bytes; }
  uint64_t used_bytes() const;
  // The largest free block of a segment, or the capacity no segment holds (room for a new one).
  uint64_t largest_free_bytes() const;
  size_t segment_count() const { return segments_.size(); }

 private:
  struct Segment {
    DeviceMemory memory;
    BestFitAllocator allocator;
  };
  CudaPool(const CudaDriver* driver, CudaPoolOptions options)
      : driver_(driver), options_(options) {}
  absl::Status AddSegment(uint64_t size);
  void InstallSegment(const DeviceMemory& memory);
  // Frees a segment's memory (cuMemFree or cuMemRelease and close). REQUIRES: the context current.
  void FreeMemory(const DeviceMemory& memory) const;
  // Resolves kAuto, and checks kVmm against the device; sets granularity_.
  absl::Status ChooseKind();

  const CudaDriver* driver_;
  CudaPoolOptions options_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  DeviceUuid uuid_{};
  uint64_t granularity_ = kCudaAlignment;
  std::vector<Segment> segments_;
  uint64_t reserved_bytes_ = 0;
  bool growing_ = false;  // between BeginGrowth and EndGrowth
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_MEMORY_CUDA_POOL_H_
