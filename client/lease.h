// Acquired tensors: the lease behind each DLManagedTensor(Versioned) the client hands out, and how
// it is built from what the daemon (or the fast path) granted. Private to the client library.
#ifndef TENSORSHM_CLIENT_LEASE_H_
#define TENSORSHM_CLIENT_LEASE_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "client/client_core.h"
#include "client/fast_path.h"
#include "client/interop.h"
#include "client/segment_map.h"
#include "common/base/mutex.h"
#include "common/cuda/cuda_driver.h"
#include "tensorshm/client.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

// Data pointer of empty tensors: non-null and 256-byte aligned, never read.
alignas(256) extern const char kEmptyData[256];

// How a lease is held: one the daemon keeps for the session (ClientCore's key for it)...
struct RpcLease {
  uint64_t key = 0;
};
// ... or a slot of the session's lease page, on the fast path.
struct PageLease {
  std::shared_ptr<FastPath> fast;  // whose page holds it
  uint32_t slot = 0;
};
// Where a leased tensor's bytes lie: in a host segment's read-only mapping (none for an empty
// tensor)...
struct HostBytes {
  std::shared_ptr<const SegmentMapping> mapping;
};
// ... or in device memory.
struct CudaBytes {
  SegmentPlace place;       // where the buffer lies (PlaceOf)
  int ordinal = -1;         // this process's device ordinal
  std::string ready_event;  // the producer's CUipcEventHandle, or empty
};

// What an acquired tensor's manager_ctx points at: the lease and storage for shape and strides.
struct Lease {
  DLManagedTensorVersioned versioned{};
  DLManagedTensor legacy{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::shared_ptr<ClientCore> core;
  std::variant<RpcLease, PageLease> held;
  std::variant<HostBytes, CudaBytes> bytes;

  // The device memory the tensor lies in; nullptr for a host tensor.
  const CudaBytes* cuda() const { return std::get_if<CudaBytes>(&bytes); }
  // Gives the lease back: its page slot at once, an RPC lease in the session's next batch.
  void GiveBack() noexcept;

  // ReadyEvent: the event opened from `ready_event` on first call, kept until the lease ends.
  Mutex event_mu;
  CUevent opened_event ABSL_GUARDED_BY(event_mu) = nullptr;
  bool own_event ABSL_GUARDED_BY(event_mu) = false;
};

// The deleters of the tensors handed out: each gives its lease back.
void DeleteVersioned(DLManagedTensorVersioned* self) noexcept;
void DeleteLegacy(DLManagedTensor* self) noexcept;

// Hands `lease` out as the caller's tensor, which owns it from here (its deleter gives it back).
inline DLManagedTensorVersioned* HandOut(std::unique_ptr<Lease> lease) {
  Lease* raw = lease.release();
  raw->versioned.deleter = DeleteVersioned;
  return &raw->versioned;
}
inline DLManagedTensor* HandOutLegacy(std::unique_ptr<Lease> lease) {
  Lease* raw = lease.release();
  raw->legacy.deleter = DeleteLegacy;
  return &raw->legacy;
}

// The place a CUDA `location` names, the buffer being at `address` in this process (host places
// come from the segment's mapping: HostPlace).
SegmentPlace PlaceFrom(const v1::Location& location, const char* address);

// The place of a host buffer at `buffer` in this process's mapping (at `segment`, `segment_size`
// bytes) of segment `key`, named `shm_name`; its length: up to the segment's end.
// FAILED_PRECONDITION once `core`'s daemon no longer serves the segment (it restarted without
// it: the name may now be another object's).
absl::StatusOr<SegmentPlace> HostPlace(ClientCore& core, const SegmentKey& key,
                                       const std::string& shm_name, const char* segment,
                                       uint64_t segment_size, const char* buffer);

// A CUDA location as this process sees it: its ordinal for the location's device (found by UUID)
// and the buffer's device address (nullptr for an empty tensor), the segment opened once.
struct CudaBuffer {
  int ordinal = -1;
  char* data = nullptr;
};

// Opens the CUDA segment of `location` (once per segment) and finds the buffer in it.
absl::StatusOr<CudaBuffer> OpenCudaLocation(ClientCore& core, const v1::Location& location);

// Points `lease`'s DLPack structs at `data` with its shape and strides.
void FillTensor(Lease& lease, const char* data, DLDevice device, DLDataType dtype,
                uint64_t byte_offset, uint64_t flags);

// Builds the tensor for a lease the daemon granted. On failure the lease is given back.
absl::StatusOr<std::unique_ptr<Lease>> MakeLease(const std::shared_ptr<ClientCore>& core,
                                                 const v1::AcquireResponse& response);

// Builds the tensor for a lease slot the fast path took, from what TryAcquire copied out of the
// record. On failure the slot is given back (the caller then asks the daemon).
absl::StatusOr<std::unique_ptr<Lease>> MakePageLease(const std::shared_ptr<ClientCore>& core,
                                                     std::shared_ptr<FastPath> fast,
                                                     FastPath::Leased& leased);

// Waits for `lease`'s ready event as `sync` says.
absl::Status WaitLeaseReady(const Lease& lease, ReadySync sync);

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_LEASE_H_
