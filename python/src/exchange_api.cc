#include "exchange_api.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <new>
#include <string>

#include "common/base/mutex.h"
#include "tensor_object.h"

namespace nb = nanobind;

namespace tensorshm::python {
namespace {

std::atomic<int64_t> calls[5];

Mutex allocator_mu;
std::weak_ptr<Client> allocator_client ABSL_GUARDED_BY(allocator_mu);

// Sets a Python exception; REQUIRES the GIL (the functions below that call it run with it, as
// the exchange API's Python-object functions are called from Python).
int PyFail(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  return -1;
}

int Allocate(DLTensor* prototype, DLManagedTensorVersioned** out, void* error_ctx,
             void (*set_error)(void*, const char*, const char*)) {
  calls[0].fetch_add(1);
  *out = nullptr;
  std::shared_ptr<Client> client = AllocatorClient();
  if (client == nullptr) {
    set_error(error_ctx, "RuntimeError",
              "tensorshm: no connected client to allocate through (call tensorshm.connect())");
    return -1;
  }
  TensorSpec spec;
  spec.dtype = prototype->dtype;
  spec.shape.assign(prototype->shape, prototype->shape + prototype->ndim);
  spec.device = prototype->device;
  tensorshm::StatusOr<WritableTensor> tensor = client->Create(spec);
  if (!tensor.ok()) {
    set_error(error_ctx, "RuntimeError", std::string(tensor.status().message()).c_str());
    return -1;
  }
  auto storage = std::make_shared<Storage>();
  storage->tensor = tensor->dl_tensor();
  storage->shape.assign(storage->tensor.shape, storage->tensor.shape + storage->tensor.ndim);
  storage->strides.assign(storage->tensor.strides, storage->tensor.strides + storage->tensor.ndim);
  storage->tensor.shape = storage->shape.data();
  storage->tensor.strides = storage->strides.data();
  storage->flags = tensor->dlpack_flags();
  storage->writable.emplace(*std::move(tensor));
  *out = *ExportVersioned(storage, /*copy=*/false);  // a view cannot fail
  return 0;
}

int ManagedFromPy(void* py_object, DLManagedTensorVersioned** out) {
  calls[1].fetch_add(1);
  nb::handle handle(static_cast<PyObject*>(py_object));
  if (!nb::isinstance<PyTensor>(handle)) {
    return PyFail(PyExc_TypeError, "tensorshm exchange API: not a tensorshm tensor");
  }
  const std::shared_ptr<Storage>* storage = LiveOrSetError(*nb::inst_ptr<PyTensor>(handle));
  if (storage == nullptr) return -1;
  *out = *ExportVersioned(*storage, /*copy=*/false);
  return 0;
}

int ManagedToPy(DLManagedTensorVersioned* tensor, void** out_py_object) {
  calls[2].fetch_add(1);
  try {
    auto storage = std::make_shared<Storage>();
    storage->versioned = tensor;  // ownership taken: its deleter runs with the storage
    storage->tensor = tensor->dl_tensor;
    storage->flags = tensor->flags &
                     (DLPACK_FLAG_BITMASK_READ_ONLY | DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED);
    const int ndim = tensor->dl_tensor.ndim;
    storage->shape.assign(tensor->dl_tensor.shape, tensor->dl_tensor.shape + ndim);
    if (tensor->dl_tensor.strides != nullptr) {
      storage->strides.assign(tensor->dl_tensor.strides, tensor->dl_tensor.strides + ndim);
    } else {
      storage->strides.assign(ndim, 1);
      for (int i = ndim - 1; i > 0; --i) {
        storage->strides[i - 1] = storage->strides[i] * storage->shape[i];
      }
    }
    storage->tensor.shape = storage->shape.data();
    storage->tensor.strides = storage->strides.data();
    nb::object object = nb::cast(PyTensor{std::move(storage), ""});
    *out_py_object = object.release().ptr();
    return 0;
  } catch (const std::exception& e) {
    return PyFail(PyExc_RuntimeError, e.what());
  }
}

int DLTensorFromPy(void* py_object, DLTensor* out) {
  calls[3].fetch_add(1);
  nb::handle handle(static_cast<PyObject*>(py_object));
  if (!nb::isinstance<PyTensor>(handle)) {
    return PyFail(PyExc_TypeError, "tensorshm exchange API: not a tensorshm tensor");
  }
  const std::shared_ptr<Storage>* storage = LiveOrSetError(*nb::inst_ptr<PyTensor>(handle));
  if (storage == nullptr) return -1;
  *out = (*storage)->tensor;
  return 0;
}

int CurrentWorkStream(DLDeviceType device_type, int32_t, void** out_current_stream) {
  calls[4].fetch_add(1);
  // Host tensors have no stream. tensorshm keeps no stream of its own: its CUDA work goes on
  // CUDA's legacy default stream, which is what a consumer should order itself after.
  *out_current_stream = device_type == kDLCUDA ? kLegacyDefaultStream : nullptr;
  return 0;
}

DLPackExchangeAPI MakeApi() {
  DLPackExchangeAPI api{};
  api.header.version.major = DLPACK_MAJOR_VERSION;
  api.header.version.minor = DLPACK_MINOR_VERSION;
  api.header.prev_api = nullptr;
  api.managed_tensor_allocator = Allocate;
  api.managed_tensor_from_py_object_no_sync = ManagedFromPy;
  api.managed_tensor_to_py_object_no_sync = ManagedToPy;
  api.dltensor_from_py_object_no_sync = DLTensorFromPy;
  api.current_work_stream = CurrentWorkStream;
  return api;
}

}  // namespace

void SetAllocatorClient(const std::shared_ptr<Client>& client) {
  MutexLock lock(&allocator_mu);
  allocator_client = client;
}

void ForgetAllocatorClient(const Client* client) {
  MutexLock lock(&allocator_mu);
  // Compared by address without locking: an expired pointer cannot be `client`, still open.
  std::shared_ptr<Client> current = allocator_client.lock();
  if (current.get() == client) allocator_client.reset();
}

std::shared_ptr<Client> AllocatorClient() {
  MutexLock lock(&allocator_mu);
  return allocator_client.lock();
}

void ForgetAllocatorClientAfterFork() {
  new (&allocator_mu) Mutex;  // the old one's state is the parent's: never unlocked here
  MutexLock lock(&allocator_mu);
  allocator_client.reset();
}

const DLPackExchangeAPI* ExchangeApi() {
  static const DLPackExchangeAPI api = MakeApi();
  return &api;
}

std::array<int64_t, 5> ExchangeApiCalls() {
  std::array<int64_t, 5> out;
  for (int i = 0; i < 5; ++i) out[i] = calls[i].load();
  return out;
}

std::map<std::string, int64_t> ExchangeApiCallsByName() {
  const std::array<int64_t, 5> calls = ExchangeApiCalls();
  const char* names[] = {"managed_tensor_allocator", "managed_tensor_from_py_object_no_sync",
                         "managed_tensor_to_py_object_no_sync", "dltensor_from_py_object_no_sync",
                         "current_work_stream"};
  std::map<std::string, int64_t> out;
  for (int i = 0; i < 5; ++i) out[names[i]] = calls[i];
  return out;
}

}  // namespace tensorshm::python
