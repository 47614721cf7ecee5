// An emulated CUDA driver for tests: the driver calls tensorshm uses, with "device memory" in
// POSIX shared memory so that IPC handles really open in other processes. It is strict where
// CUDA is: calls need a current context, a handle does not open in the process that allocated
// it nor in a context of another device, a handle opened twice in one context is reference
// counted, interprocess events must disable timing. Device pointers are host addresses of the
// mapping, so tests can look at "device" bytes directly. Virtual memory management (cuMemCreate,
// file descriptors, reserve / map / access) is in vmm.cc; the state both share in state.h.
#include "tests/support/fake_cuda/fake_cuda.h"

#include <cuda.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tests/support/fake_cuda/state.h"

namespace tsm_fake_cuda {
namespace {

thread_local std::vector<CUctx_st*> context_stack;

}  // namespace

State& state() {
  static State* s = new State();
  return *s;
}

CUctx_st* Current() { return context_stack.empty() ? nullptr : context_stack.back(); }

bool IsDeviceRange(State& s, CUdeviceptr ptr, size_t n, bool write) {
  auto inside = [&](uintptr_t base, size_t size) { return ptr >= base && ptr + n <= base + size; };
  auto a = s.allocations.upper_bound(ptr);
  if (a != s.allocations.begin() && inside(std::prev(a)->first, std::prev(a)->second.size)) {
    return true;
  }
  auto o = s.opened.upper_bound(ptr);
  if (o != s.opened.begin() && inside(std::prev(o)->first, std::prev(o)->second.second.size)) {
    return true;
  }
  // VMM mappings: one range may span mappings that lie next to each other, each with the access.
  const int needed = write ? PROT_READ | PROT_WRITE : PROT_READ;
  uintptr_t at = ptr;
  const uintptr_t end = ptr + n;
  while (at < end) {
    auto m = s.mappings.upper_bound(at);
    if (m == s.mappings.begin()) return false;
    --m;
    if (at >= m->first + m->second.size || (m->second.access & needed) != needed) return false;
    at = m->first + m->second.size;
  }
  return n > 0;
}

}  // namespace tsm_fake_cuda

using tsm_fake_cuda::Current;
using tsm_fake_cuda::IsDeviceRange;
using tsm_fake_cuda::Opened;
using tsm_fake_cuda::State;
using tsm_fake_cuda::state;

namespace {

constexpr uint32_t kMemMagic = 0x4d435354;    // "TSCM"
constexpr uint32_t kEventMagic = 0x45435354;  // "TSCE"

struct IpcHandle {
  uint32_t magic;
  int32_t pid;
  int32_t physical;
  uint32_t reserved;
  uint64_t size;
  char name[40];
};
static_assert(sizeof(IpcHandle) == CU_IPC_HANDLE_SIZE);

std::string NewName(State& s, const char* kind) {
  return "/tsmfakecu." + std::to_string(getpid()) + "." + kind + std::to_string(++s.next_name);
}

void* MapShm(const std::string& name, size_t size, bool create) {
  const int fd = shm_open(name.c_str(), create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  if (create && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return nullptr;
  }
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return addr == MAP_FAILED ? nullptr : addr;
}

// The errors this driver returns, with CUDA's names and texts.
struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;
};

constexpr ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};

const ErrorText* FindError(CUresult code) {
  for (const ErrorText& e : kErrors) {
    if (e.code == code) return &e;
  }
  return nullptr;
}

bool ProcessAlive(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

}  // namespace

extern "C" {

const TsmFakeCudaCounters* tsm_fake_cuda_counters() { return &state().counters; }

int64_t tsm_fake_cuda_live_events() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.live_events;
}

int64_t tsm_fake_cuda_open_mappings() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<int64_t>(s.opened.size());
}

CUresult cuInit(unsigned int flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (const char* e = std::getenv("TSM_FAKE_CUDA_INIT_ERROR"); e != nullptr && *e == '1') {
    return CUDA_ERROR_NO_DEVICE;
  }
  if (s.initialized) return CUDA_SUCCESS;
  int physical = 2;
  if (const char* e = std::getenv("TSM_FAKE_CUDA_DEVICES"); e != nullptr) physical = std::atoi(e);
  s.contexts.resize(static_cast<size_t>(physical));
  for (int p = 0; p < physical; ++p) s.contexts[p].physical = p;
  if (const char* e = std::getenv("TSM_FAKE_CUDA_VISIBLE"); e != nullptr) {
    for (const char* c = e; *c != '\0';) {
      const int p = std::atoi(c);
      if (p < 0 || p >= physical) return CUDA_ERROR_INVALID_DEVICE;
      s.visible.push_back(p);
      while (*c != '\0' && *c != ',') ++c;
      if (*c == ',') ++c;
    }
  } else {
    for (int p = 0; p < physical; ++p) s.visible.push_back(p);
  }
  s.initialized = true;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** name) {
  const ErrorText* e = FindError(error);
  *name = e != nullptr ? e->name : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char** text) {
  const ErrorText* e = FindError(error);
  *text = e != nullptr ? e->text : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDeviceGetCount(int* count) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  *count = static_cast<int>(s.visible.size());
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (ordinal < 0 || ordinal >= static_cast<int>(s.visible.size())) {
    return CUDA_ERROR_INVALID_DEVICE;
  }
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (device < 0 || device >= static_cast<int>(s.visible.size())) return CUDA_ERROR_INVALID_DEVICE;
  // A fixed pattern with the physical index, the same in every process.
  const unsigned char bytes[16] = {0x7e, 0x45, 0x50, 0xfa, 0x4b, 0xe0, 0x4c, 0x0d,
                                   0x9a, 0x11, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  std::memcpy(uuid->bytes, bytes, 16);
  uuid->bytes[15] = static_cast<char>(s.visible[device]);
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (device < 0 || device >= static_cast<int>(s.visible.size())) return CUDA_ERROR_INVALID_DEVICE;
  CUctx_st* ctx = &s.contexts[s.visible[device]];
  ++ctx->retained;
  ++s.counters.primary_ctx_retain;
  *context = ctx;
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (device < 0 || device >= static_cast<int>(s.visible.size())) return CUDA_ERROR_INVALID_DEVICE;
  CUctx_st* ctx = &s.contexts[s.visible[device]];
  if (ctx->retained == 0) return CUDA_ERROR_INVALID_CONTEXT;
  --ctx->retained;
  ++s.counters.primary_ctx_release;
  return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext context) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (context == nullptr || context->retained == 0) return CUDA_ERROR_INVALID_CONTEXT;
  tsm_fake_cuda::context_stack.push_back(context);
  return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext* context) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (context != nullptr) *context = Current();
  tsm_fake_cuda::context_stack.pop_back();
  return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t size) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  const std::string name = NewName(s, "mem");
  void* addr = MapShm(name, size, /*create=*/true);
  if (addr == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = reinterpret_cast<CUdeviceptr>(addr);
  s.allocations[*ptr] = tsm_fake_cuda::Allocation{name, size, Current()->physical};
  ++s.counters.mem_alloc;
  return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  auto it = s.allocations.find(ptr);
  if (it == s.allocations.end()) return CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(ptr), it->second.size);
  shm_unlink(it->second.name.c_str());
  s.allocations.erase(it);
  ++s.counters.mem_free;
  return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (!IsDeviceRange(s, dst, n, /*write=*/true)) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  ++s.counters.memcpy_htod;
  return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (!IsDeviceRange(s, src, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  ++s.counters.memcpy_dtoh;
  return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (!IsDeviceRange(s, dst, n, /*write=*/true) || !IsDeviceRange(s, src, n)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // Streams run in order; this one finishes at once.
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  ++s.counters.memcpy_dtod;
  return CUDA_SUCCESS;
}

CUresult cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr ptr) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  auto it = s.allocations.find(ptr);
  if (it == s.allocations.end()) return CUDA_ERROR_INVALID_VALUE;
  IpcHandle h{};
  h.magic = kMemMagic;
  h.pid = getpid();
  h.physical = it->second.physical;
  h.size = it->second.size;
  std::snprintf(h.name, sizeof(h.name), "%s", it->second.name.c_str());
  std::memcpy(handle->reserved, &h, sizeof(h));
  ++s.counters.ipc_get_mem_handle;
  return CUDA_SUCCESS;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* ptr, CUipcMemHandle handle, unsigned int flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  IpcHandle h;
  std::memcpy(&h, handle.reserved, sizeof(h));
  if (h.magic != kMemMagic || flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (h.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT;  // as CUDA: not in the exporter
  CUctx_st* ctx = Current();
  if (ctx->physical != h.physical) return CUDA_ERROR_INVALID_DEVICE;
  const std::string name(h.name, strnlen(h.name, sizeof(h.name)));
  if (auto it = s.opened_by_name.find({ctx, name}); it != s.opened_by_name.end()) {
    ++s.opened[it->second].second.references;
    *ptr = it->second;
    ++s.counters.ipc_open_calls;
    return CUDA_SUCCESS;
  }
  if (!ProcessAlive(h.pid)) return CUDA_ERROR_INVALID_HANDLE;  // its memory died with it
  void* addr = MapShm(name, h.size, /*create=*/false);
  if (addr == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *ptr = reinterpret_cast<CUdeviceptr>(addr);
  s.opened_by_name[{ctx, name}] = *ptr;
  s.opened[*ptr] = {ctx, Opened{name, h.size, 1}};
  ++s.counters.ipc_open_calls;
  ++s.counters.ipc_open_mappings;
  return CUDA_SUCCESS;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  auto it = s.opened.find(ptr);
  if (it == s.opened.end()) return CUDA_ERROR_INVALID_VALUE;
  ++s.counters.ipc_close_calls;
  if (--it->second.second.references > 0) return CUDA_SUCCESS;
  munmap(reinterpret_cast<void*>(ptr), it->second.second.size);
  s.opened_by_name.erase({it->second.first, it->second.second.name});
  s.opened.erase(it);
  ++s.counters.ipc_unmappings;
  return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  const bool ipc = (flags & CU_EVENT_INTERPROCESS) != 0;
  if (ipc && (flags & CU_EVENT_DISABLE_TIMING) == 0) return CUDA_ERROR_INVALID_VALUE;
  auto* e = new CUevent_st();
  e->flags = flags;
  if (ipc) {
    e->shm_name = NewName(s, "event");
    e->records = static_cast<std::atomic<int64_t>*>(MapShm(e->shm_name, 4096, /*create=*/true));
    if (e->records == nullptr) {
      delete e;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  } else {
    e->records = new std::atomic<int64_t>(0);
  }
  ++s.counters.event_create;
  ++s.live_events;
  *event = e;
  return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent event, CUstream) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  event->records->fetch_add(1);
  ++s.counters.event_record;
  return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent event) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  ++s.counters.event_synchronize;
  if (event->records->load() > 0) ++s.counters.waits_on_recorded;
  return CUDA_SUCCESS;
}

// Work is done when issued here, so a recorded event has always completed, unless
// TSM_FAKE_CUDA_BUSY_QUERIES=N (read at each call) makes the first N queries after each record
// (seen by this process) report it unfinished, as a GPU still running the producer's kernels; a
// lower N later cuts what is left short (0: everything has finished).
CUresult cuEventQuery(CUevent event) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  ++s.counters.event_query;
  const char* busy_env = getenv("TSM_FAKE_CUDA_BUSY_QUERIES");
  const int64_t busy = busy_env != nullptr ? atoll(busy_env) : 0;
  const int64_t records = event->records->load();
  if (records != event->queried_records) {
    event->queried_records = records;
    event->busy_queries = busy;
  }
  // Lowered meanwhile (to 0: the GPU is done with everything).
  event->busy_queries = std::min(event->busy_queries, busy);
  if (event->busy_queries > 0) {
    --event->busy_queries;
    return CUDA_ERROR_NOT_READY;
  }
  return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent event) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (event->shm_name.empty()) {
    delete event->records;
  } else {
    munmap(event->records, 4096);
    if (event->owner) shm_unlink(event->shm_name.c_str());
  }
  if (event->owner) --s.live_events;
  delete event;
  return CUDA_SUCCESS;
}

CUresult cuIpcGetEventHandle(CUipcEventHandle* handle, CUevent event) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (event == nullptr || event->shm_name.empty() || !event->owner) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  IpcHandle h{};
  h.magic = kEventMagic;
  h.pid = getpid();
  h.physical = Current()->physical;
  std::snprintf(h.name, sizeof(h.name), "%s", event->shm_name.c_str());
  std::memcpy(handle->reserved, &h, sizeof(h));
  ++s.counters.ipc_get_event_handle;
  return CUDA_SUCCESS;
}

CUresult cuIpcOpenEventHandle(CUevent* event, CUipcEventHandle handle) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  IpcHandle h;
  std::memcpy(&h, handle.reserved, sizeof(h));
  if (h.magic != kEventMagic) return CUDA_ERROR_INVALID_VALUE;
  if (h.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT;
  auto* e = new CUevent_st();
  e->flags = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
  e->shm_name.assign(h.name, strnlen(h.name, sizeof(h.name)));
  e->owner = false;
  e->records = static_cast<std::atomic<int64_t>*>(MapShm(e->shm_name, 4096, /*create=*/false));
  if (e->records == nullptr) {
    delete e;
    return CUDA_ERROR_INVALID_HANDLE;
  }
  ++s.counters.ipc_open_event_handle;
  *event = e;
  return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream, CUevent event, unsigned int flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (event == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  ++s.counters.stream_wait_event;
  if (event->records->load() > 0) ++s.counters.waits_on_recorded;
  return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  return CUDA_SUCCESS;
}

// Streams: work runs when issued, so a stream is only a handle, always idle.
CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  if (stream == nullptr || (flags & ~CU_STREAM_NON_BLOCKING) != 0) return CUDA_ERROR_INVALID_VALUE;
  *stream = reinterpret_cast<CUstream>(new char(0));
  return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream stream) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_INIT(s);
  if (stream == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  delete reinterpret_cast<char*>(stream);
  return CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  REQUIRE_CONTEXT(s);
  return CUDA_SUCCESS;
}

}  // extern "C"
