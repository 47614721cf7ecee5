// The emulated driver's virtual memory management, as strict as CUDA's where tensorshm relies on
// it: allocations of the granularity's multiples (2 MiB, as on an H100 or H200), exported and
// imported as POSIX file descriptors (a memfd stands for the device memory, so a descriptor passed
// with SCM_RIGHTS maps the same bytes in another process), address ranges reserved, mapped and
// given access per device. Access is enforced with mprotect on the host memory that stands for
// the device: a mapping without access faults on any touch, a read-only mapping on a write (the
// writing process dies with SIGSEGV), and driver calls that would write it (cuMemcpyHtoD,
// cuMemsetD8) return CUDA_ERROR_INVALID_VALUE, as the real driver refuses cuMemsetD8 through a
// read-only mapping and the context stays usable.
//
// Environment: TSM_FAKE_CUDA_NO_VMM=1 makes devices report no VMM and no POSIX descriptor
// support (a driver or device without them).
#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>

#include "tests/support/fake_cuda/state.h"

using tsm_fake_cuda::Current;
using tsm_fake_cuda::State;
using tsm_fake_cuda::state;
using tsm_fake_cuda::VmmAllocation;
using tsm_fake_cuda::VmmMapping;

namespace {

constexpr size_t kGranularity = size_t{2} << 20;

bool VmmSupported() {
  const char* off = std::getenv("TSM_FAKE_CUDA_NO_VMM");
  return off == nullptr || std::strcmp(off, "1") != 0;
}

bool Aligned(size_t value) { return value % kGranularity == 0; }

// The physical device of `location` (a device ordinal of this process), or -1.
int PhysicalOf(State& s, const CUmemLocation& location) {
  if (location.type != CU_MEM_LOCATION_TYPE_DEVICE || location.id < 0 ||
      location.id >= static_cast<int>(s.visible.size())) {
    return -1;
  }
  return s.visible[location.id];
}

// The physical device a memfd made by cuMemCreate stands for: its name says it
// ("tsmfakecu-vmm-<physical>"); -1 for any other descriptor.
int PhysicalOfFd(int fd) {
  char link[128];
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
  if (n <= 0) return -1;
  link[n] = '\0';
  const char* prefix = "/memfd:tsmfakecu-vmm-";
  if (std::strncmp(link, prefix, std::strlen(prefix)) != 0) return -1;
  return std::atoi(link + std::strlen(prefix));
}

// The reservation holding [ptr, ptr + size), or end().
std::map<uintptr_t, size_t>::iterator ReservationOf(State& s, uintptr_t ptr, size_t size) {
  auto r = s.reservations.upper_bound(ptr);
  if (r == s.reservations.begin()) return s.reservations.end();
  --r;
  return ptr + size <= r->first + r->second ? r : s.reservations.end();
}

// True if some mapping overlaps [ptr, ptr + size).
bool Overlaps(State& s, uintptr_t ptr, size_t size) {
  auto m = s.mappings.lower_bound(ptr + size);
  if (m == s.mappings.begin()) return false;
  --m;
  return m->first + m->second.size > ptr;
}

}  // namespace

namespace tsm_fake_cuda {

void DropIfUnused(State& s, uint64_t handle) {
  auto it = s.vmm_allocations.find(handle);
  if (it == s.vmm_allocations.end() || !it->second.released || it->second.mappings > 0) return;
  close(it->second.fd);
  s.vmm_allocations.erase(it);
}

}  // namespace tsm_fake_cuda

extern "C" {

int64_t tsm_fake_cuda_vmm_allocations() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<int64_t>(s.vmm_allocations.size());
}

CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (device < 0 || device >= static_cast<int>(s.visible.size())) return CUDA_ERROR_INVALID_DEVICE;
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
      *value = VmmSupported() ? 1 : 0;
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_INVALID_VALUE;  // only what tensorshm asks
  }
}

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (granularity == nullptr || prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      PhysicalOf(s, prop->location) < 0 ||
      (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
       option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!VmmSupported()) return CUDA_ERROR_NOT_SUPPORTED;
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                     const CUmemAllocationProp* prop, unsigned long long flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (handle == nullptr || prop == nullptr || flags != 0 || size == 0 || !Aligned(size) ||
      prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const int physical = PhysicalOf(s, prop->location);
  if (physical < 0) return CUDA_ERROR_INVALID_DEVICE;
  if (!VmmSupported()) return CUDA_ERROR_NOT_SUPPORTED;
  const bool posix_fd = prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (!posix_fd && prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) {
    return CUDA_ERROR_INVALID_VALUE;  // only the POSIX descriptor is emulated
  }
  const std::string name = "tsmfakecu-vmm-" + std::to_string(physical);
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  // Reserved now, as device memory is taken at cuMemCreate.
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      fallocate(fd, 0, 0, static_cast<off_t>(size)) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *handle = ++s.next_handle;
  s.vmm_allocations[*handle] = VmmAllocation{fd, size, physical, posix_fd, false, 0};
  ++s.counters.mem_alloc;
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  auto it = s.vmm_allocations.find(handle);
  if (it == s.vmm_allocations.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  it->second.released = true;
  ++s.counters.mem_free;
  tsm_fake_cuda::DropIfUnused(s, handle);  // mapped: freed with its last mapping
  return CUDA_SUCCESS;
}

CUresult cuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType type, unsigned long long flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  auto it = s.vmm_allocations.find(handle);
  if (shareable == nullptr || flags != 0 || it == s.vmm_allocations.end() || it->second.released ||
      type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !it->second.posix_fd) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // A new descriptor of the caller's to close (or pass on).
  const int fd = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(shareable) = fd;
  return CUDA_SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os_handle,
                                        CUmemAllocationHandleType type) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (handle == nullptr || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // The descriptor is passed as the pointer's value; the caller keeps (and closes) it.
  const int given = static_cast<int>(reinterpret_cast<intptr_t>(os_handle));
  const int physical = PhysicalOfFd(given);
  struct stat st;
  if (physical < 0 || fstat(given, &st) != 0 || st.st_size <= 0 ||
      !Aligned(static_cast<size_t>(st.st_size))) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const int fd = fcntl(given, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *handle = ++s.next_handle;
  s.vmm_allocations[*handle] =
      VmmAllocation{fd, static_cast<size_t>(st.st_size), physical, true, false, 0};
  ++s.counters.vmm_import;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (ptr == nullptr || size == 0 || !Aligned(size) || flags != 0 || addr != 0 ||
      (alignment != 0 && (alignment & (alignment - 1)) != 0)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const size_t align = alignment > kGranularity ? alignment : kGranularity;
  // Address space only: reserved with no access, aligned by trimming an over-sized reservation.
  void* raw =
      mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t base = (start + align - 1) / align * align;
  if (base > start) munmap(raw, base - start);
  if (const uintptr_t tail = start + size + align - (base + size); tail > 0) {
    munmap(reinterpret_cast<void*>(base + size), tail);
  }
  s.reservations[base] = size;
  *ptr = base;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  auto r = s.reservations.find(ptr);
  if (r == s.reservations.end() || r->second != size || Overlaps(s, ptr, size)) {
    return CUDA_ERROR_INVALID_VALUE;  // a whole reservation, unmapped first
  }
  munmap(reinterpret_cast<void*>(ptr), size);
  s.reservations.erase(r);
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  auto it = s.vmm_allocations.find(handle);
  if (it == s.vmm_allocations.end() || it->second.released || flags != 0 || size == 0 ||
      !Aligned(ptr) || !Aligned(size) || !Aligned(offset) || offset > it->second.size ||
      size > it->second.size - offset || ReservationOf(s, ptr, size) == s.reservations.end() ||
      Overlaps(s, ptr, size)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // Mapped with no access until cuMemSetAccess, as CUDA maps it.
  void* mapped = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                      it->second.fd, static_cast<off_t>(offset));
  if (mapped == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  ++it->second.mappings;
  s.mappings[ptr] = VmmMapping{size, handle, it->second.physical, PROT_NONE};
  ++s.counters.vmm_map;
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  // Whole mappings only, from `ptr` on.
  uintptr_t at = ptr;
  for (auto m = s.mappings.find(ptr); at < ptr + size; m = s.mappings.find(at)) {
    if (m == s.mappings.end() || at + m->second.size > ptr + size) return CUDA_ERROR_INVALID_VALUE;
    at += m->second.size;
  }
  if (size == 0 || at != ptr + size) return CUDA_ERROR_INVALID_VALUE;
  for (at = ptr; at < ptr + size;) {
    auto m = s.mappings.find(at);
    const VmmMapping mapping = m->second;
    s.mappings.erase(m);
    // Back to reserved address space with no access.
    mmap(reinterpret_cast<void*>(at), mapping.size, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    --s.vmm_allocations[mapping.allocation].mappings;
    tsm_fake_cuda::DropIfUnused(s, mapping.allocation);
    at += mapping.size;
  }
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (desc == nullptr || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  // A range of whole mappings, one after another ("a fully mapped address range containing all
  // allocations": the access of part of a mapping cannot be changed).
  uintptr_t at = ptr;
  for (auto m = s.mappings.find(ptr); at < ptr + size; m = s.mappings.find(at)) {
    if (m == s.mappings.end() || at + m->second.size > ptr + size) return CUDA_ERROR_INVALID_VALUE;
    at += m->second.size;
  }
  // The access of the device the memory is on (one device per process stands for all).
  for (auto m = s.mappings.find(ptr); m != s.mappings.end() && m->first < ptr + size; ++m) {
    int access = -1;
    for (size_t i = 0; i < count; ++i) {
      if (PhysicalOf(s, desc[i].location) < 0) return CUDA_ERROR_INVALID_DEVICE;
      if (PhysicalOf(s, desc[i].location) != m->second.physical) continue;
      switch (desc[i].flags) {
        case CU_MEM_ACCESS_FLAGS_PROT_NONE:
          access = PROT_NONE;
          break;
        case CU_MEM_ACCESS_FLAGS_PROT_READ:
          access = PROT_READ;
          break;
        case CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
          access = PROT_READ | PROT_WRITE;
          break;
        default:
          return CUDA_ERROR_INVALID_VALUE;
      }
    }
    if (access < 0) continue;  // no descriptor for its device: unchanged
    if (mprotect(reinterpret_cast<void*>(m->first), m->second.size, access) != 0) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    m->second.access = access;
  }
  ++s.counters.vmm_set_access;
  return CUDA_SUCCESS;
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream) {
  return cuMemsetD8_v2(dst, value, n);  // done when issued, as all work here
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (!tsm_fake_cuda::IsDeviceRange(s, dst, n, /*write=*/true)) return CUDA_ERROR_INVALID_VALUE;
  std::memset(reinterpret_cast<void*>(dst), value, n);
  return CUDA_SUCCESS;
}

}  // extern "C"
