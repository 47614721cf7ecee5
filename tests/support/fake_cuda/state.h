// The emulated CUDA driver's state, shared by its files: fake_cuda.cc (devices, contexts,
// cuMemAlloc memory, IPC handles, events) and vmm.cc (virtual memory management: cuMemCreate,
// reservations, mappings and their access). Private to the library.
#ifndef TENSORSHM_TESTS_SUPPORT_FAKE_CUDA_STATE_H_
#define TENSORSHM_TESTS_SUPPORT_FAKE_CUDA_STATE_H_

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tests/support/fake_cuda/fake_cuda.h"

struct CUctx_st {
  int physical = 0;
  int retained = 0;
};

struct CUevent_st {
  unsigned int flags = 0;
  std::string shm_name;  // interprocess events: their shared page
  bool owner = true;     // created here (not opened from a handle)
  std::atomic<int64_t>* records = nullptr;
  // TSM_FAKE_CUDA_BUSY_QUERIES: the records count the last cuEventQuery saw, and how many more
  // queries report the work behind that record unfinished.
  int64_t queried_records = -1;
  int64_t busy_queries = 0;
};

namespace tsm_fake_cuda {

struct Allocation {
  std::string name;
  size_t size;
  int physical;
};

struct Opened {
  std::string name;
  size_t size;
  int references;
};

// A cuMemCreate allocation (or one imported from its file descriptor): a memfd standing for the
// device memory. Freed when it is released and no mapping holds it.
struct VmmAllocation {
  int fd = -1;
  size_t size = 0;
  int physical = 0;
  bool posix_fd = false;  // created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested
  bool released = false;  // cuMemRelease called
  int mappings = 0;       // cuMemMap-ed ranges that hold it
};

// A cuMemMap-ped range: which allocation, at which offset, and its access (cuMemSetAccess).
struct VmmMapping {
  size_t size = 0;
  uint64_t allocation = 0;  // handle
  int physical = 0;
  int access = 0;  // PROT_NONE, PROT_READ or PROT_READ | PROT_WRITE
};

struct State {
  std::mutex mu;
  bool initialized = false;
  std::vector<int> visible;  // ordinal -> physical device
  std::vector<CUctx_st> contexts;
  std::map<uintptr_t, Allocation> allocations;  // by base address
  // Opened handles, per context: (context, name) -> base, and base -> record.
  std::map<std::pair<CUctx_st*, std::string>, uintptr_t> opened_by_name;
  std::map<uintptr_t, std::pair<CUctx_st*, Opened>> opened;
  int next_name = 0;
  int64_t live_events = 0;  // created here and not destroyed
  TsmFakeCudaCounters counters{};
  // Virtual memory management.
  std::map<uint64_t, VmmAllocation> vmm_allocations;  // by handle
  uint64_t next_handle = 0;
  std::map<uintptr_t, size_t> reservations;  // cuMemAddressReserve: base -> size
  std::map<uintptr_t, VmmMapping> mappings;  // cuMemMap: base -> mapping
};

State& state();
// The calling thread's current context, nullptr if none.
CUctx_st* Current();
// True if [ptr, ptr + n) lies in one allocation, opened IPC mapping or VMM mapping of this
// process (a VMM mapping must give at least read access, and with `write` write access too).
bool IsDeviceRange(State& s, CUdeviceptr ptr, size_t n, bool write = false);
// Frees a released VMM allocation that no mapping holds any more.
void DropIfUnused(State& s, uint64_t handle);

}  // namespace tsm_fake_cuda

#define REQUIRE_INIT(s) \
  if (!(s).initialized) return CUDA_ERROR_NOT_INITIALIZED
#define REQUIRE_CONTEXT(s) \
  REQUIRE_INIT(s);         \
  if (Current() == nullptr) return CUDA_ERROR_INVALID_CONTEXT

#endif  // TENSORSHM_TESTS_SUPPORT_FAKE_CUDA_STATE_H_
