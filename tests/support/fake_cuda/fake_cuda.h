// The emulated CUDA driver's test interface: call counters, read by tests through dlsym on the
// same library that TENSORSHM_LIBCUDA names.
//
// Environment of a process using it:
//   TSM_FAKE_CUDA_DEVICES=N      physical devices on the "machine" (default 2)
//   TSM_FAKE_CUDA_VISIBLE=2,0    which physical devices this process sees, in ordinal order (as
//                                CUDA_VISIBLE_DEVICES permutes them); default all, in order
//   TSM_FAKE_CUDA_INIT_ERROR=1   cuInit fails (CUDA_ERROR_NO_DEVICE)
//   TSM_FAKE_CUDA_BUSY_QUERIES=N the first N cuEventQuery calls on an event after each record
//                                report CUDA_ERROR_NOT_READY (read at each call)
//   TSM_FAKE_CUDA_NO_VMM=1       devices report no virtual memory management and no POSIX file
//                                descriptor handles; cuMemCreate is CUDA_ERROR_NOT_SUPPORTED
#ifndef TENSORSHM_TESTS_SUPPORT_FAKE_CUDA_FAKE_CUDA_H_
#define TENSORSHM_TESTS_SUPPORT_FAKE_CUDA_FAKE_CUDA_H_

#include <cstdint>

extern "C" {

struct TsmFakeCudaCounters {
  int64_t mem_alloc;
  int64_t mem_free;
  int64_t ipc_get_mem_handle;
  int64_t ipc_open_calls;     // cuIpcOpenMemHandle calls that succeeded
  int64_t ipc_open_mappings;  // ... of which mapped the memory (not a reference-counted reopen)
  int64_t ipc_close_calls;    // cuIpcCloseMemHandle calls that succeeded
  int64_t ipc_unmappings;     // ... of which unmapped the memory (the last reference)
  int64_t event_create;
  int64_t event_record;
  int64_t ipc_get_event_handle;
  int64_t ipc_open_event_handle;
  int64_t stream_wait_event;  // cuStreamWaitEvent calls
  int64_t waits_on_recorded;  // ... and cuEventSynchronize calls, on an event recorded earlier
  int64_t event_synchronize;
  int64_t memcpy_htod;
  int64_t memcpy_dtoh;
  int64_t memcpy_dtod;
  int64_t primary_ctx_retain;
  int64_t primary_ctx_release;
  int64_t vmm_import;      // cuMemImportFromShareableHandle calls that succeeded
  int64_t vmm_map;         // cuMemMap calls that succeeded
  int64_t vmm_set_access;  // cuMemSetAccess calls that succeeded
  int64_t event_query;     // cuEventQuery calls
};

// This process's counters.
const TsmFakeCudaCounters* tsm_fake_cuda_counters();
// Mappings opened through cuIpcOpenMemHandle and not yet closed, over all contexts.
int64_t tsm_fake_cuda_open_mappings();
// Events this process created (cuEventCreate) and has not destroyed.
int64_t tsm_fake_cuda_live_events();
// VMM allocations (cuMemCreate, cuMemImportFromShareableHandle) not yet freed: not released, or
// released and still mapped.
int64_t tsm_fake_cuda_vmm_allocations();

}  // extern "C"

#endif  // TENSORSHM_TESTS_SUPPORT_FAKE_CUDA_FAKE_CUDA_H_
