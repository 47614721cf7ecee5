// What only the bindings (python/src) use: the ready event of an acquired CUDA tensor, and
// copies and stream waits on this process's CUDA devices. Not part of the public API: the
// bindings link the client library's objects themselves.
#ifndef TENSORSHM_CLIENT_INTEROP_H_
#define TENSORSHM_CLIENT_INTEROP_H_

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensorshm/client.h"

namespace tensorshm {

// For bindings that hand the ready event on (the Arrow C Device Data Interface's sync_event): a
// pointer to a CUevent, opened in this process on first call and valid as long as `tensor`'s
// lease is held (kept open for this process's later acquires, or given back to this process's
// producer side, when it ends); a consumer waits on it (cuStreamWaitEvent) before using the
// tensor. nullptr for host tensors, CUDA tensors published without an event, and those whose
// producer process has ended (its event went with it, and its device work). INVALID_ARGUMENT for a
// tensor that did not come from a tensorshm Client; errors of the driver opening the event.
// Thread-safe.
absl::StatusOr<const void*> ReadyEvent(const DLManagedTensorVersioned* tensor);

// Where a tensor's buffer lies in the daemon's memory, for bindings that register the segment
// with a server that maps it itself (Triton's system and CUDA shared-memory extensions).
struct SegmentPlace {
  // With segment_id, names one host segment for good (v1::Location.segment_instance); a CUDA
  // segment is named by the two on its device only.
  uint64_t segment_instance = 0;
  uint64_t segment_id = 0;
  uint64_t segment_size = 0;
  uint64_t offset = 0;  // of the buffer in the segment
  uint64_t length = 0;  // from `address` to the segment's end; 0: an empty tensor, no segment
  // The buffer's address in this process (host: in this process's mapping of the segment; CUDA:
  // the device pointer).
  const char* address = nullptr;
  std::string shm_name;         // host: the POSIX shm object's name; "" for a memfd segment
  std::string cuda_ipc_handle;  // CUDA: the segment's 64-byte CUipcMemHandle
};

// The place of an acquired tensor's buffer (valid while its lease is held). INVALID_ARGUMENT for
// a tensor that did not come from a tensorshm Client; FAILED_PRECONDITION for a host tensor whose
// segment the client's daemon no longer serves (it restarted without it).
absl::StatusOr<SegmentPlace> PlaceOf(const DLManagedTensorVersioned* tensor);
// The place of a writable tensor's buffer (published or not). FAILED_PRECONDITION for a
// moved-from tensor, and as PlaceOf above.
absl::StatusOr<SegmentPlace> PlaceOf(const WritableTensor& tensor);

// LeaseStatus and WaitReady of client.h, in the library's own status type.
absl::Status LeaseStatusOf(const DLManagedTensorVersioned* tensor);
absl::Status WaitReadyOf(const DLManagedTensorVersioned* tensor, ReadySync sync);

// Copies `bytes` of an acquired CUDA tensor's device memory, starting at `src` (inside the
// tensor), to host memory `dst`, after its ready event. INVALID_ARGUMENT for a tensor that is not
// a CUDA tensor acquired from a tensorshm Client.
absl::Status CopyToHost(const DLManagedTensorVersioned* tensor, const void* src, void* dst,
                        size_t bytes);

// Copies `bytes` from device memory `src` to device memory `dst` on this process's CUDA device
// `ordinal`, asynchronously on `stream`, with `client`'s driver. FAILED_PRECONDITION in a forked
// child.
absl::Status CopyOnDevice(Client& client, int ordinal, void* dst, const void* src, size_t bytes,
                          CudaStream stream);

// Makes `stream` of this process's CUDA device `ordinal` wait for `event` (a CUevent of this
// process, e.g. an Arrow C Device Data Interface sync_event's target). FAILED_PRECONDITION in a
// forked child.
absl::Status StreamWaitEvent(Client& client, int ordinal, CudaStream stream, void* event);

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_INTEROP_H_
