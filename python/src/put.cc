#include "put.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "copy_in.h"
#include "dlpack_export.h"
#include "raise_status.h"
#include "storage.h"
#include "waits.h"

namespace nb = nanobind;

namespace tensorshm::python {
namespace {

// Copies `source` into a new tensor and publishes it. CUDA sources are copied on `stream` (the
// stream their producer's work is ordered on), which the ready event is then recorded on.
// `cancel`: the caller's canceller for the wait for memory (only with release_gil: a wait with
// the GIL held cannot be cancelled from Python).
PyTensor PutFromDLTensor(PyClient& self, const std::string& name, const DLTensor& source,
                         uint64_t flags, bool replace, absl::Duration timeout, bool release_gil,
                         CudaStream stream = kLegacyDefaultStream,
                         const std::optional<WaitCanceller>& cancel = std::nullopt) {
  ClientRef client = Live(*self.state);
  using Result = tensorshm::StatusOr<DLManagedTensorVersioned*>;
  auto run_for = [&](absl::Duration wait, const WaitCanceller* c) -> Result {
    tensorshm::StatusOr<WritableTensor> tensor = CopyIn(*client, source, flags, stream, wait, c);
    if (!tensor.ok()) return tensor.status();
    return client->PublishAndAcquire(*tensor, name, replace, stream);
  };
  auto run = [&](const WaitCanceller* c) -> Result { return run_for(timeout, c); };
  Result lease;
  if (!release_gil) {
    lease = run(nullptr);
  } else if (timeout == absl::ZeroDuration()) {
    ReleaseGil release;
    lease = run(nullptr);
  } else {
    lease = RunWaiting<Result>(
        *self.state, cancel,
        [&](bool*) -> std::optional<Result> {
          // Memory free now: no wait (a full pool fails the copy before it starts).
          Result now = run_for(absl::ZeroDuration(), nullptr);
          if (now.status().code() == StatusCode::kResourceExhausted) return std::nullopt;
          return now;
        },
        [&](const WaitCanceller& c) { return run(&c); });
  }
  return PyTensor{FromLease(Check(std::move(lease))), name};
}

const DLPackExchangeAPI* ExchangeApiFrom(nb::handle api) {
  if (PyLong_Check(api.ptr())) {
    return reinterpret_cast<const DLPackExchangeAPI*>(nb::cast<uintptr_t>(api));
  }
  if (PyCapsule_IsValid(api.ptr(), "dlpack_exchange_api")) {
    return static_cast<const DLPackExchangeAPI*>(
        PyCapsule_GetPointer(api.ptr(), "dlpack_exchange_api"));
  }
  throw nb::type_error(
      "__dlpack_c_exchange_api__ must be a PyCapsule named \"dlpack_exchange_api\" or an int");
}

}  // namespace

PyTensor PutCapsule(PyClient& self, const std::string& name, nb::handle capsule, bool replace,
                    const std::optional<double>& timeout,
                    const std::optional<WaitCanceller>& cancel) {
  const absl::Duration wait = TimeoutFrom(timeout);
  PyObject* object = capsule.ptr();
  if (PyCapsule_IsValid(object, kVersioned)) {
    auto* managed =
        static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(object, kVersioned));
    if (managed->version.major != DLPACK_MAJOR_VERSION) {
      throw nb::value_error(absl::StrCat("DLPack capsule of version ", managed->version.major, ".",
                                         managed->version.minor, ": only major version ",
                                         DLPACK_MAJOR_VERSION, " is understood")
                                .c_str());
    }
    PyCapsule_SetName(object, kUsedVersioned);  // consumed: the capsule's destructor lets go
    std::unique_ptr<DLManagedTensorVersioned, void (*)(DLManagedTensorVersioned*)> owned(
        managed, [](DLManagedTensorVersioned* m) {
          if (m->deleter != nullptr) m->deleter(m);
        });
    return PutFromDLTensor(self, name, managed->dl_tensor, managed->flags, replace, wait, true,
                           kLegacyDefaultStream, cancel);
  }
  if (PyCapsule_IsValid(object, kLegacy)) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(object, kLegacy));
    PyCapsule_SetName(object, kUsedLegacy);
    std::unique_ptr<DLManagedTensor, void (*)(DLManagedTensor*)> owned(managed,
                                                                       [](DLManagedTensor* m) {
                                                                         if (m->deleter != nullptr)
                                                                           m->deleter(m);
                                                                       });
    return PutFromDLTensor(self, name, managed->dl_tensor, 0, replace, wait, true,
                           kLegacyDefaultStream, cancel);
  }
  if (PyCapsule_IsValid(object, kUsedVersioned) || PyCapsule_IsValid(object, kUsedLegacy)) {
    throw nb::value_error("DLPack capsule already consumed: a capsule can be consumed only once");
  }
  throw nb::type_error("expected a DLPack capsule named \"dltensor_versioned\" or \"dltensor\"");
}

PyTensor PutExchange(PyClient& self, const std::string& name, nb::handle obj, nb::handle api_object,
                     bool replace, const std::optional<double>& timeout) {
  const absl::Duration wait = TimeoutFrom(timeout);
  const DLPackExchangeAPI* api = ExchangeApiFrom(api_object);
  if (api == nullptr || api->header.version.major != DLPACK_MAJOR_VERSION) {
    throw nb::value_error("__dlpack_c_exchange_api__: missing, or of another DLPack major version");
  }
  // No-sync exports: a CUDA tensor is copied on its producer's current work stream, so the copy
  // follows the producer's writes.
  auto producer_stream = [&](const DLDevice& device) -> CudaStream {
    void* stream = kLegacyDefaultStream;
    if (device.device_type == kDLCUDA && api->current_work_stream != nullptr &&
        api->current_work_stream(device.device_type, device.device_id, &stream) != 0) {
      throw nb::python_error();
    }
    return stream;
  };
  // The non-owning view is valid only while we hold the GIL, so its copy runs with the GIL held:
  // only when the put does not wait for memory (a wait with the GIL held would stop every other
  // thread, and close() could not wake it). Waiting puts take the owning export and wait through
  // RunWaiting, without the GIL and cancellable.
  if (api->dltensor_from_py_object_no_sync != nullptr &&
      (wait == absl::ZeroDuration() || api->managed_tensor_from_py_object_no_sync == nullptr)) {
    DLTensor view{};
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &view) != 0) throw nb::python_error();
    return PutFromDLTensor(self, name, view, 0, replace, wait, /*release_gil=*/false,
                           producer_stream(view.device));
  }
  DLManagedTensorVersioned* managed = nullptr;
  if (api->managed_tensor_from_py_object_no_sync(obj.ptr(), &managed) != 0) {
    throw nb::python_error();
  }
  std::unique_ptr<DLManagedTensorVersioned, void (*)(DLManagedTensorVersioned*)> owned(
      managed, [](DLManagedTensorVersioned* m) {
        if (m->deleter != nullptr) m->deleter(m);
      });
  return PutFromDLTensor(self, name, managed->dl_tensor, managed->flags, replace, wait, true,
                         producer_stream(managed->dl_tensor.device));
}

}  // namespace tensorshm::python
