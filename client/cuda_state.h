// A client's CUDA side: the driver (loaded on first use), this process's ordinal for each
// device UUID, the primary contexts it retained, the segments' IPC memory handles it opened (at
// most once per segment) and the ready events it recorded.
#ifndef TENSORSHM_CLIENT_CUDA_STATE_H_
#define TENSORSHM_CLIENT_CUDA_STATE_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "client/segment_map.h"
#include "common/base/mutex.h"
#include "common/cuda/cuda_driver.h"

namespace tensorshm {

// Ready events a producer keeps before it first looks for ones to destroy.
inline constexpr size_t kMinReadyEventSweep = 64;

// Thread-safe. Everything opened or created is closed or destroyed in the destructor, which runs
// when the client and every tensor from it are gone; ready events go earlier, once the tensor
// they were recorded for is gone (SweepReadyEvents).
class CudaState {
 public:
  CudaState() = default;
  ~CudaState();
  CudaState(const CudaState&) = delete;
  CudaState& operator=(const CudaState&) = delete;

  // This process's ordinal of the device with `uuid` (16 bytes). FAILED_PRECONDITION if there is
  // no driver or no visible device has that UUID.
  absl::StatusOr<int> OrdinalOf(const std::string& uuid) ABSL_LOCKS_EXCLUDED(mu_);

  // The 16-byte UUID of this process's device `ordinal`. INVALID_ARGUMENT for an ordinal no
  // visible device has; FAILED_PRECONDITION without a driver.
  absl::StatusOr<std::string> UuidOf(int ordinal) ABSL_LOCKS_EXCLUDED(mu_);

  // The base address of segment `key` (segment_instance, segment_id), exported as `handle` (a
  // 64-byte CUipcMemHandle), opened in device `ordinal`'s primary context on first use and
  // cached under (ordinal, key): a restarted daemon's segment is another key, whatever its
  // handle's bytes.
  absl::StatusOr<CUdeviceptr> OpenSegment(int ordinal, const SegmentKey& key,
                                          const std::string& handle) ABSL_LOCKS_EXCLUDED(mu_);

  // Records a new interprocess event on `stream` of device `ordinal` for tensor `tensor_id` and
  // returns its 64-byte CUipcEventHandle. The event lives until a sweep finds the tensor gone
  // (acquirers open the handle as long as the daemon holds the tensor), or this state goes.
  absl::StatusOr<std::string> RecordReadyEvent(int ordinal, CUstream stream, uint64_t tensor_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Bounds the ready events a long-running producer keeps: once there are `sweep_at` or more
  // (at least kMinReadyEventSweep, and twice as many as the last sweep left), asks
  // `held_tensor_ids` for the ids of every tensor the daemon still holds and destroys the events
  // of tensors not among them (none that a WaitReady of this process is using). Events recorded
  // while `held_tensor_ids` runs are kept. Returns how many were destroyed.
  int SweepReadyEvents(size_t sweep_at,
                       const std::function<void(std::vector<uint64_t>*)>& held_tensor_ids)
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t ready_event_count() const ABSL_LOCKS_EXCLUDED(mu_);

  // Orders the caller after the event exported as `handle`: `stream` waits on it
  // (cuStreamWaitEvent), or with host_wait the calling thread does (cuEventSynchronize).
  absl::Status WaitReady(int ordinal, const std::string& handle, bool host_wait, CUstream stream)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Opens the event exported as `handle` for as long as the caller keeps it: an event this
  // process recorded is used as it is (and kept from sweeps until CloseEvent), another process's
  // is opened (cuIpcOpenEventHandle). `*own` says which, for CloseEvent.
  absl::StatusOr<CUevent> OpenEvent(int ordinal, const std::string& handle, bool* own)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Lets go of an event OpenEvent returned. Safe on any thread.
  void CloseEvent(int ordinal, const std::string& handle, CUevent event, bool own)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `stream` of device `ordinal` waits for `event` (cuStreamWaitEvent).
  absl::Status StreamWaitEvent(int ordinal, CUstream stream, CUevent event)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Device-to-device / device-to-host copies in device `ordinal`'s context.
  absl::Status CopyDeviceToDevice(int ordinal, CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                                  CUstream stream) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CopyDeviceToHost(int ordinal, void* dst, CUdeviceptr src, size_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The driver and the UUID table, loaded once. REQUIRES: mu_ held.
  absl::Status Load() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Device `ordinal`'s primary context, retained on first use.
  absl::StatusOr<CUcontext> Context(int ordinal) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Loads the driver and runs `fn()` (returning a Status or StatusOr) under mu_ with device
  // `ordinal`'s primary context current.
  template <typename Fn>
  auto InContext(int ordinal, Fn&& fn) ABSL_LOCKS_EXCLUDED(mu_);

  struct ReadyEvent {
    int ordinal = 0;
    CUevent event = nullptr;
    uint64_t tensor_id = 0;
    uint64_t serial = 0;  // order of recording
    int waits = 0;        // WaitReady calls using it now
  };

  mutable Mutex mu_;
  const CudaDriver* driver_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<DeviceUuid> uuids_ ABSL_GUARDED_BY(mu_);      // by ordinal
  std::map<int, CUcontext> contexts_ ABSL_GUARDED_BY(mu_);  // retained primary contexts
  std::map<std::pair<int, SegmentKey>, CUdeviceptr> segments_ ABSL_GUARDED_BY(mu_);
  // Ready events this process recorded, by their IPC handle: waits in this process use them
  // directly, as CUDA does not open an IPC handle in the process that exported it.
  std::map<std::string, ReadyEvent> events_ ABSL_GUARDED_BY(mu_);
  uint64_t next_event_serial_ ABSL_GUARDED_BY(mu_) = 1;
  size_t events_after_sweep_ ABSL_GUARDED_BY(mu_) = 0;  // what the last sweep left
  bool sweeping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_CUDA_STATE_H_
