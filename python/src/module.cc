// tensorshm._tensorshm: the nanobind extension under the `tensorshm` Python package.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <sys/mman.h>

#include <cmath>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "arrow.h"
#include "common/dtype.h"
#include "common/wire.h"
#include "copy_in.h"
#include "exchange_api.h"
#include "storage.h"
#include "tensor_object.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace tensorshm::python {
namespace {

constexpr char kVersioned[] = "dltensor_versioned";
constexpr char kUsedVersioned[] = "used_dltensor_versioned";
constexpr char kLegacy[] = "dltensor";
constexpr char kUsedLegacy[] = "used_dltensor";

// Raises the tensorshm exception for `status` (tensorshm._errors maps codes to classes).
[[noreturn]] void Raise(const absl::Status& status) {
  nb::module_::import_("tensorshm._errors")
      .attr("_raise_status")(static_cast<int>(status.code()), std::string(status.message()));
  throw std::runtime_error("tensorshm._errors._raise_status returned");  // unreachable
}

[[noreturn]] void RaiseBufferError(const std::string& message) {
  PyErr_SetString(PyExc_BufferError, message.c_str());
  throw nb::python_error();
}

template <typename T>
T Check(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

std::string Describe(const PyTensor& t) {
  return t.name.empty() ? std::string("tensor") : absl::StrCat("tensor \"", t.name, "\"");
}

// ---- storage from the sources a Python tensor can have ----

std::shared_ptr<Storage> FromLease(DLManagedTensorVersioned* lease) {
  auto storage = std::make_shared<Storage>();
  storage->versioned = lease;
  storage->lease = true;
  storage->tensor = lease->dl_tensor;  // shape/strides stay owned by the lease
  storage->flags = lease->flags;
  storage->shape.assign(lease->dl_tensor.shape, lease->dl_tensor.shape + lease->dl_tensor.ndim);
  storage->strides.assign(lease->dl_tensor.strides,
                          lease->dl_tensor.strides + lease->dl_tensor.ndim);
  storage->tensor.shape = storage->shape.data();
  storage->tensor.strides = storage->strides.data();
  return storage;
}

std::shared_ptr<Storage> FromWritable(WritableTensor tensor) {
  auto storage = std::make_shared<Storage>();
  storage->tensor = tensor.dl_tensor();
  storage->shape.assign(storage->tensor.shape, storage->tensor.shape + storage->tensor.ndim);
  storage->strides.assign(storage->tensor.strides, storage->tensor.strides + storage->tensor.ndim);
  storage->tensor.shape = storage->shape.data();
  storage->tensor.strides = storage->strides.data();
  storage->flags = tensor.dlpack_flags();
  // The storage keeps the mapping so that views taken before publish stay valid after it.
  auto [mapping, length] = tensor.TakeMapping();
  storage->mapping = mapping;
  storage->mapping_length = length;
  storage->writable.emplace(std::move(tensor));
  return storage;
}

// ---- __dlpack__ ----

void DestroyCapsule(PyObject* capsule) {
  // Runs when the capsule dies; a consumer that took it renamed it to used_*, and owns it now.
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (PyCapsule_IsValid(capsule, kVersioned)) {
    auto* managed =
        static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, kVersioned));
    if (managed->deleter != nullptr) managed->deleter(managed);
  } else if (PyCapsule_IsValid(capsule, kLegacy)) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kLegacy));
    if (managed->deleter != nullptr) managed->deleter(managed);
  }
  PyErr_Restore(type, value, traceback);
}

nb::object DLPack(PyTensor& self, nb::handle stream, nb::handle max_version, nb::handle dl_device,
                  nb::handle copy) {
  const DLDevice device = self.storage->tensor.device;
  const bool cuda = device.device_type == kDLCUDA;
  // DLPack stream rules: CPU tensors take None; for CUDA, None is the legacy default stream,
  // -1 asks for no synchronisation, 0 is ambiguous and refused, any other int is a CUstream.
  std::optional<CudaStream> consumer_stream;
  if (!cuda) {
    if (!stream.is_none()) {
      throw nb::value_error(
          absl::StrCat("stream = ", nb::repr(stream).c_str(), ": CPU tensors take stream=None")
              .c_str());
    }
  } else if (stream.is_none()) {
    consumer_stream = kLegacyDefaultStream;
  } else {
    const intptr_t value = nb::cast<intptr_t>(stream);
    if (value == 0) {
      throw nb::value_error(
          "stream = 0: ambiguous for CUDA in DLPack; pass 1 (legacy default stream), 2 "
          "(per-thread default stream), a CUstream, -1 (no synchronisation) or None");
    }
    if (value != -1) consumer_stream = reinterpret_cast<CudaStream>(value);
  }
  bool want_copy = false;
  if (!copy.is_none()) want_copy = nb::cast<bool>(copy);
  int wanted_type = device.device_type;  // the device type the consumer asks for
  if (!dl_device.is_none()) {
    auto [type, id] = nb::cast<std::pair<int, int>>(dl_device);
    wanted_type = type;
    const bool same = type == device.device_type && id == device.device_id;
    if (!same) {
      if (!copy.is_none() && !want_copy) {
        RaiseBufferError(absl::StrCat("dl_device = (", type, ", ", id, ") needs a copy of this ",
                                      DeviceName(device), " tensor, and copy=False forbids it"));
      }
      const bool host_like = type == kDLCPU || type == kDLCUDAHost;
      if (!host_like || (device.device_type != kDLCPU && !(cuda && type == kDLCPU))) {
        RaiseBufferError(absl::StrCat("dl_device = (", type, ", ", id, "): cannot copy a ",
                                      DeviceName(device), " tensor there"));
      }
      want_copy = true;
    }
  }
  if (cuda && want_copy && wanted_type == kDLCUDA) {
    RaiseBufferError(absl::StrCat(Describe(self), " is on ", DeviceName(device),
                                  ": copy=True makes a host copy only, with dl_device=(1, 0)"));
  }
  // A host copy waits for the producer's ready event itself; a view orders the consumer's
  // stream after it.
  if (cuda && !want_copy && consumer_stream.has_value() && self.storage->lease) {
    absl::Status s;
    {
      nb::gil_scoped_release release;
      s = WaitReady(self.storage->versioned, ReadySync::Stream(*consumer_stream));
    }
    Check(s);
  }
  bool versioned = false;
  if (!max_version.is_none()) {
    auto [major, minor] = nb::cast<std::pair<int, int>>(max_version);
    (void)minor;
    versioned = major >= 1;
  }
  const bool read_only = (self.storage->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
  if (versioned) {
    DLManagedTensorVersioned* managed = Check(ExportVersioned(self.storage, want_copy));
    PyObject* capsule = PyCapsule_New(managed, kVersioned, DestroyCapsule);
    if (capsule == nullptr) {
      managed->deleter(managed);
      throw nb::python_error();
    }
    return nb::steal(capsule);
  }
  // A pre-1.0 capsule cannot say "read-only", and a consumer may write through it into memory
  // other processes read. With copy=None (the array API's "reuse if possible, copy otherwise")
  // such a consumer (JAX passes only stream=) gets a private host copy it owns; copy=False
  // refuses. A CUDA tensor is not copied behind the consumer's back: the copy would be on the
  // host, not on the device __dlpack_device__ names, so that asks for dl_device=(1, 0).
  if (read_only && !want_copy) {
    if (!copy.is_none()) {
      RaiseBufferError(absl::StrCat(
          Describe(self), " is read-only shared memory; a pre-1.0 DLPack capsule (max_version=",
          nb::repr(max_version).c_str(),
          ") cannot say so, and copy=False forbids a private copy. Pass max_version=(1, 0) or "
          "later (numpy >= 2.1, torch >= 2.4), or ",
          cuda ? "dl_device=(1, 0) for a host copy." : "copy=None/True for a private copy."));
    }
    if (cuda) {
      RaiseBufferError(absl::StrCat(
          Describe(self), " is read-only ", DeviceName(device),
          " memory, and a pre-1.0 DLPack capsule (max_version=", nb::repr(max_version).c_str(),
          ") cannot say so; tensorshm makes no device copies. Use a consumer that passes "
          "max_version=(1, 0) or later (torch >= 2.4, cupy >= 13), or ask for a host copy "
          "with dl_device=(1, 0)."));
    }
    want_copy = true;
  }
  DLManagedTensor* managed = Check(ExportLegacy(self.storage, want_copy));
  PyObject* capsule = PyCapsule_New(managed, kLegacy, DestroyCapsule);
  if (capsule == nullptr) {
    managed->deleter(managed);
    throw nb::python_error();
  }
  return nb::steal(capsule);
}

// ---- the buffer protocol ----

const char* BufferFormat(const DLDataType& dtype) {
  if (dtype.lanes != 1) return nullptr;
  switch (dtype.code) {
    case kDLInt:
      switch (dtype.bits) {
        case 8:
          return "b";
        case 16:
          return "h";
        case 32:
          return "i";
        case 64:
          return "q";
      }
      return nullptr;
    case kDLUInt:
      switch (dtype.bits) {
        case 8:
          return "B";
        case 16:
          return "H";
        case 32:
          return "I";
        case 64:
          return "Q";
      }
      return nullptr;
    case kDLFloat:
      switch (dtype.bits) {
        case 16:
          return "e";
        case 32:
          return "f";
        case 64:
          return "d";
      }
      return nullptr;
    case kDLComplex:
      switch (dtype.bits) {
        case 64:
          return "Zf";
        case 128:
          return "Zd";
      }
      return nullptr;
    case kDLBool:
      return "?";
  }
  return nullptr;
}

// Exports `storage`'s tensor as a Py_buffer on behalf of `owner`.
int ExportBuffer(PyObject* owner, const Storage& storage, const std::string& what, Py_buffer* view,
                 int flags, bool raw) {
  view->obj = nullptr;
  const DLTensor& t = storage.tensor;
  const bool read_only = (storage.flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
  const bool padded = (storage.flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
  auto fail = [](const std::string& message) {
    PyErr_SetString(PyExc_BufferError, message.c_str());
    return -1;
  };
  if ((flags & PyBUF_WRITABLE) == PyBUF_WRITABLE && read_only) {
    return fail(what + " is read-only (published tensors are sealed)");
  }
  if (t.device.device_type != kDLCPU) {
    return fail(what + " is on " + DeviceName(t.device) + ", not in host memory");
  }
  auto* internal = new std::vector<Py_ssize_t>();
  if (raw) {
    const StorageSpan span = SpanOf(t, padded);
    view->buf = const_cast<char*>(span.start);
    view->len = span.nbytes;
    view->itemsize = 1;
    view->format = (flags & PyBUF_FORMAT) ? const_cast<char*>("B") : nullptr;
    view->ndim = 1;
    internal->assign({span.nbytes, 1});
    view->shape = internal->data();
    view->strides = internal->data() + 1;
  } else {
    const char* format = BufferFormat(t.dtype);
    if (format == nullptr) {
      delete internal;
      return fail(what + " has dtype " + DataTypeName(t.dtype) +
                  ", which the buffer protocol cannot describe; use tensorshm.to_numpy(t) or "
                  "np.from_dlpack(t)");
    }
    const int64_t item = ElementBits(t.dtype) / 8;
    int64_t numel = 1;
    bool c_contiguous = true;
    bool f_contiguous = true;
    int64_t c_step = 1, f_step = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && t.strides[i] != c_step) c_contiguous = false;
      c_step *= t.shape[i];
    }
    for (int i = 0; i < t.ndim; ++i) {
      if (t.shape[i] != 1 && t.strides[i] != f_step) f_contiguous = false;
      f_step *= t.shape[i];
      numel *= t.shape[i];
    }
    if ((flags & PyBUF_C_CONTIGUOUS) == PyBUF_C_CONTIGUOUS && !c_contiguous) {
      delete internal;
      return fail(what + " is not C-contiguous");
    }
    if ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS && !f_contiguous) {
      delete internal;
      return fail(what + " is not Fortran-contiguous");
    }
    if ((flags & PyBUF_ANY_CONTIGUOUS) == PyBUF_ANY_CONTIGUOUS && !c_contiguous && !f_contiguous) {
      delete internal;
      return fail(what + " is not contiguous");
    }
    if ((flags & PyBUF_STRIDES) != PyBUF_STRIDES && !c_contiguous) {
      delete internal;
      return fail(what + " is strided and the consumer did not ask for strides");
    }
    view->buf = static_cast<char*>(t.data) + t.byte_offset;
    view->len = numel * item;
    view->itemsize = item;
    view->format = (flags & PyBUF_FORMAT) ? const_cast<char*>(format) : nullptr;
    view->ndim = t.ndim;
    internal->resize(2 * t.ndim);
    for (int i = 0; i < t.ndim; ++i) {
      (*internal)[i] = t.shape[i];
      (*internal)[t.ndim + i] = t.strides[i] * item;
    }
    view->shape = internal->data();
    view->strides = internal->data() + t.ndim;
  }
  view->readonly = read_only ? 1 : 0;
  view->suboffsets = nullptr;
  view->internal = internal;
  view->obj = owner;
  Py_INCREF(owner);
  return 0;
}

void ReleaseBuffer(PyObject*, Py_buffer* view) {
  delete static_cast<std::vector<Py_ssize_t>*>(view->internal);
}

int TensorGetBuffer(PyObject* self, Py_buffer* view, int flags) {
  const PyTensor* t = nb::inst_ptr<PyTensor>(nb::handle(self));
  return ExportBuffer(self, *t->storage, Describe(*t), view, flags, /*raw=*/false);
}

// The bytes of a tensor's storage, 1-d, for building numpy views of dtypes the buffer protocol
// cannot name (ml_dtypes).
struct RawStorage {
  std::shared_ptr<Storage> storage;
};

int RawGetBuffer(PyObject* self, Py_buffer* view, int flags) {
  const RawStorage* raw = nb::inst_ptr<RawStorage>(nb::handle(self));
  return ExportBuffer(self, *raw->storage, "tensor storage", view, flags, /*raw=*/true);
}

PyType_Slot tensor_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(TensorGetBuffer)},
                              {Py_bf_releasebuffer, reinterpret_cast<void*>(ReleaseBuffer)},
                              {0, nullptr}};
PyType_Slot raw_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(RawGetBuffer)},
                           {Py_bf_releasebuffer, reinterpret_cast<void*>(ReleaseBuffer)},
                           {0, nullptr}};

// ---- Client ----

absl::Duration TimeoutFrom(const std::optional<double>& seconds) {
  if (!seconds.has_value()) return absl::InfiniteDuration();
  if (std::isnan(*seconds) || *seconds < 0) {
    Raise(
        absl::InvalidArgumentError(absl::StrCat("timeout = ", *seconds, ": must be >= 0 or None")));
  }
  if (std::isinf(*seconds)) return absl::InfiniteDuration();
  return absl::Seconds(*seconds);
}

// "cpu", "cpu:0", "cuda" (= "cuda:0") or "cuda:N".
DLDevice ParseDevice(const std::string& device) {
  if (device == "cpu" || device == "cpu:0") return DLDevice{kDLCPU, 0};
  int ordinal = 0;
  if (device == "cuda") return DLDevice{kDLCUDA, 0};
  if (device.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(device.substr(5), &ordinal) &&
      ordinal >= 0) {
    return DLDevice{kDLCUDA, ordinal};
  }
  Raise(absl::InvalidArgumentError(
      absl::StrCat("device = \"", device, "\": expected \"cpu\", \"cuda\" or \"cuda:N\"")));
}

PyTensor Get(PyClient& self, const std::string& name, const std::optional<double>& timeout) {
  const absl::Duration wait = TimeoutFrom(timeout);
  absl::StatusOr<DLManagedTensorVersioned*> lease;
  {
    nb::gil_scoped_release release;
    // CUDA tensors: consumers' streams wait for the ready event in __dlpack__.
    lease = self.client->Acquire(name, wait, ReadySync::None());
  }
  return PyTensor{FromLease(Check(std::move(lease))), name};
}

PyWritableTensor Create(PyClient& self, const std::vector<int64_t>& shape, const std::string& dtype,
                        const std::optional<std::vector<int64_t>>& strides,
                        const std::string& device, bool subbyte_padded,
                        const std::optional<double>& timeout) {
  const absl::Duration wait = TimeoutFrom(timeout);
  TensorSpec spec;
  spec.dtype = Check(ParseDataType(dtype));
  spec.shape = shape;
  if (strides.has_value()) spec.strides = *strides;
  spec.device = ParseDevice(device);
  spec.subbyte_padded = subbyte_padded;
  absl::StatusOr<WritableTensor> tensor;
  {
    nb::gil_scoped_release release;
    tensor = self.client->Create(spec, wait);
  }
  PyWritableTensor out;
  out.storage = FromWritable(Check(std::move(tensor)));
  out.client = self.client;
  return out;
}

// Publishes `tensor` and returns the sealed tensor holding a lease on it.
void PublishWritable(PyWritableTensor& self, const std::string& name, bool replace) {
  Storage& storage = *self.storage;
  if (!storage.writable.has_value() || storage.writable->published()) {
    Raise(absl::FailedPreconditionError(absl::StrCat(Describe(self), ": already published")));
  }
  absl::StatusOr<DLManagedTensorVersioned*> lease;
  {
    nb::gil_scoped_release release;
    lease = self.client->PublishAndAcquire(*storage.writable, name, replace);
  }
  DLManagedTensorVersioned* held = Check(std::move(lease));
  // Sealed: views taken while writing stay valid (the lease keeps the buffer) but read-only.
  if (storage.mapping != nullptr) mprotect(storage.mapping, storage.mapping_length, PROT_READ);
  storage.versioned = held;
  storage.lease = true;
  storage.flags |= DLPACK_FLAG_BITMASK_READ_ONLY;
  self.name = name;
}

// Copies `source` into a new tensor and publishes it. CUDA sources are copied on `stream` (the
// stream their producer's work is ordered on), which the ready event is then recorded on.
PyTensor PutFromDLTensor(PyClient& self, const std::string& name, const DLTensor& source,
                         uint64_t flags, bool replace, absl::Duration timeout, bool release_gil,
                         CudaStream stream = kLegacyDefaultStream) {
  absl::StatusOr<DLManagedTensorVersioned*> lease;
  auto run = [&] {
    absl::StatusOr<WritableTensor> tensor = CopyIn(*self.client, source, flags, stream, timeout);
    if (!tensor.ok()) {
      lease = tensor.status();
      return;
    }
    lease = self.client->PublishAndAcquire(*tensor, name, replace, stream);
  };
  if (release_gil) {
    nb::gil_scoped_release release;
    run();
  } else {
    run();
  }
  return PyTensor{FromLease(Check(std::move(lease))), name};
}

PyTensor PutCapsule(PyClient& self, const std::string& name, nb::handle capsule, bool replace,
                    const std::optional<double>& timeout) {
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
    return PutFromDLTensor(self, name, managed->dl_tensor, managed->flags, replace, wait, true);
  }
  if (PyCapsule_IsValid(object, kLegacy)) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(object, kLegacy));
    PyCapsule_SetName(object, kUsedLegacy);
    std::unique_ptr<DLManagedTensor, void (*)(DLManagedTensor*)> owned(managed,
                                                                       [](DLManagedTensor* m) {
                                                                         if (m->deleter != nullptr)
                                                                           m->deleter(m);
                                                                       });
    return PutFromDLTensor(self, name, managed->dl_tensor, 0, replace, wait, true);
  }
  if (PyCapsule_IsValid(object, kUsedVersioned) || PyCapsule_IsValid(object, kUsedLegacy)) {
    throw nb::value_error("DLPack capsule already consumed: a capsule can be consumed only once");
  }
  throw nb::type_error("expected a DLPack capsule named \"dltensor_versioned\" or \"dltensor\"");
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
  if (api->dltensor_from_py_object_no_sync != nullptr) {
    // Non-owning and valid only until we return: copy with the GIL held and `obj` referenced.
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

nb::dict StatDict(PyClient& self) {
  absl::StatusOr<ServerStats> stats;
  {
    nb::gil_scoped_release release;
    stats = self.client->Stat();
  }
  ServerStats s = Check(std::move(stats));
  nb::dict out;
  out["tensors"] = s.tensors;
  out["leases"] = s.leases;
  out["sessions"] = s.sessions;
  out["names"] = s.names;
  out["evicted_tensors"] = s.evicted_tensors;
  out["evicted_bytes"] = s.evicted_bytes;
  out["creates_waiting"] = s.creates_waiting;
  nb::list pools;
  for (const PoolStats& p : s.pools) {
    nb::dict pool;
    pool["device"] = DeviceName(p.device);
    pool["capacity_bytes"] = p.capacity_bytes;
    pool["used_bytes"] = p.used_bytes;
    pools.append(pool);
  }
  out["pools"] = pools;
  return out;
}

nb::list ListDicts(PyClient& self, const std::string& prefix) {
  absl::StatusOr<std::vector<TensorInfo>> listed;
  {
    nb::gil_scoped_release release;
    listed = self.client->List(prefix);
  }
  nb::list out;
  for (const TensorInfo& info : Check(std::move(listed))) {
    nb::dict d;
    d["name"] = info.name;
    d["shape"] = nb::tuple(nb::cast(info.shape));
    d["dtype"] = DataTypeName(info.dtype);
    d["device"] = DeviceName(info.device);
    d["nbytes"] = info.nbytes;
    d["leases"] = info.leases;
    out.append(d);
  }
  return out;
}

nb::tuple ShapeOf(const PyTensor& t) { return nb::tuple(nb::cast(t.storage->shape)); }

}  // namespace
}  // namespace tensorshm::python

NB_MODULE(_tensorshm, m) {
  using namespace tensorshm::python;
  using tensorshm::Client;
  m.doc() = "tensorshm's native layer; use the `tensorshm` package.";

  nb::class_<RawStorage>(m, "_RawStorage", nb::type_slots(raw_slots));

  nb::class_<PyTensor> tensor(m, "Tensor", nb::type_slots(tensor_slots),
                              "A tensor in tensorshm shared memory (read-only once published; "
                              "for CUDA tensors the read-only flag is advisory, as CUDA IPC maps "
                              "device memory writable).");
  tensor
      .def("__dlpack__", &DLPack, nb::kw_only(), "stream"_a = nb::none(),
           "max_version"_a = nb::none(), "dl_device"_a = nb::none(), "copy"_a = nb::none(),
           "The tensor as a DLPack capsule. With max_version >= (1, 0): a zero-copy view "
           "flagged read-only when the tensor is (numpy, torch, tvm-ffi). Without it (JAX, "
           "pre-1.0 consumers), a legacy capsule cannot say read-only: a published host "
           "tensor is then handed over as a private copy the consumer owns (copy=False "
           "refuses), and a published CUDA tensor is refused unless dl_device=(1, 0) asks for "
           "a host copy. copy=True always copies to host memory.")
      .def("__dlpack_device__",
           [](const PyTensor& t) {
             return std::make_pair(static_cast<int>(t.storage->tensor.device.device_type),
                                   static_cast<int>(t.storage->tensor.device.device_id));
           })
      .def_prop_ro("shape", &ShapeOf)
      .def_prop_ro("strides",
                   [](const PyTensor& t) { return nb::tuple(nb::cast(t.storage->strides)); })
      .def_prop_ro(
          "dtype",
          [](const PyTensor& t) { return tensorshm::DataTypeName(t.storage->tensor.dtype); })
      .def_prop_ro(
          "device",
          [](const PyTensor& t) { return tensorshm::DeviceName(t.storage->tensor.device); })
      .def_prop_ro("nbytes",
                   [](const PyTensor& t) {
                     const bool padded =
                         (t.storage->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
                     return SpanOf(t.storage->tensor, padded).nbytes;
                   })
      .def_prop_ro("name",
                   [](const PyTensor& t) -> std::optional<std::string> {
                     if (t.name.empty()) return std::nullopt;
                     return t.name;
                   })
      .def_prop_ro(
          "read_only",
          [](const PyTensor& t) { return (t.storage->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0; })
      .def_prop_ro("subbyte_padded",
                   [](const PyTensor& t) {
                     return (t.storage->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
                   })
      .def_prop_ro(
          "alive", [](const PyTensor& t) { return t.storage->LeaseStatus().ok(); },
          "Whether tensorshmd still reserves this tensor's memory for it. False once a restarted "
          "daemon did not take the tensor's lease back (the memory stays mapped and readable, but "
          "its bytes are no longer guaranteed), and in a process forked from the one that "
          "acquired it (the lease is the parent's); check() raises saying which. True for "
          "tensors that hold no lease: foreign tensors, and unpublished writable tensors (a "
          "restarted daemon that did not take one back makes its publish() raise DataLossError).")
      .def(
          "check", [](const PyTensor& t) { Check(t.storage->LeaseStatus()); },
          "Returns None while the tensor is alive; otherwise raises DataLossError (a restarted "
          "daemon did not take its lease back) or FailedPreconditionError (in a forked child: "
          "connect and get it again there).")
      .def_prop_ro("_data_ptr",
                   [](const PyTensor& t) {
                     return reinterpret_cast<uintptr_t>(t.storage->tensor.data) +
                            t.storage->tensor.byte_offset;
                   })
      .def("_raw_storage",
           [](const PyTensor& t) {
             const bool padded =
                 (t.storage->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
             const StorageSpan span = SpanOf(t.storage->tensor, padded);
             return std::make_pair(RawStorage{t.storage}, span.element0);
           })
      .def("__repr__", [](const PyTensor& t) {
        const Storage& s = *t.storage;
        return absl::StrCat(
            "tensorshm.",
            s.writable.has_value() && !s.writable->published() ? "WritableTensor" : "Tensor", "(",
            t.name.empty() ? "" : absl::StrCat("name='", t.name, "', "), "shape=(",
            absl::StrJoin(s.shape, ", "), s.shape.size() == 1 ? ",)" : ")", ", dtype='",
            tensorshm::DataTypeName(s.tensor.dtype), "', device='",
            tensorshm::DeviceName(s.tensor.device),
            "', read_only=", (s.flags & DLPACK_FLAG_BITMASK_READ_ONLY) ? "True" : "False", ")");
      });
  // The DLPack 1.3 C exchange API, on the type (consumers look it up on type(obj)).
  tensor.attr("__dlpack_c_exchange_api__") = nb::steal(
      PyCapsule_New(const_cast<DLPackExchangeAPI*>(ExchangeApi()), "dlpack_exchange_api", nullptr));
  DefineArrowExports(tensor);

  nb::class_<PyWritableTensor, PyTensor>(m, "WritableTensor",
                                         "A tensor being filled; publish() seals it.")
      .def("publish", &PublishWritable, "name"_a, "replace"_a = false)
      .def_prop_ro("published", [](const PyWritableTensor& t) {
        return !t.storage->writable.has_value() || t.storage->writable->published();
      });

  nb::class_<PyClient> client(m, "_Client");
  DefineArrowImport(client);
  client
      .def_static(
          "connect",
          [](const std::optional<std::string>& socket, const std::optional<std::string>& name,
             double timeout, std::optional<int64_t> server_uid) {
            tensorshm::ClientOptions options;
            if (socket.has_value()) options.socket = *socket;
            if (name.has_value()) options.client_name = *name;
            options.connect_timeout = absl::Seconds(timeout);
            if (server_uid.has_value()) {
              if (*server_uid < 0 || *server_uid >= int64_t{UINT32_MAX}) {
                throw nb::value_error(absl::StrCat("server_uid = ", *server_uid,
                                                   ": must be a uid, 0 to ", UINT32_MAX - 1)
                                          .c_str());
              }
              options.server_uid = static_cast<uint32_t>(*server_uid);
            }
            absl::StatusOr<std::shared_ptr<Client>> client;
            {
              nb::gil_scoped_release release;
              client = Client::Connect(options);
            }
            PyClient out{Check(std::move(client))};
            SetAllocatorClient(out.client);
            return out;
          },
          "socket"_a = nb::none(), "client_name"_a = nb::none(), "timeout"_a = 5.0,
          "server_uid"_a = nb::none())
      .def("get", &Get, "name"_a, "timeout"_a = 0.0)
      .def("create", &Create, "shape"_a, "dtype"_a, "strides"_a = nb::none(), "device"_a = "cpu",
           "subbyte_padded"_a = false, "timeout"_a = 0.0)
      .def("put_capsule", &PutCapsule, "name"_a, "capsule"_a, "replace"_a = false,
           "timeout"_a = 0.0)
      .def("put_exchange", &PutExchange, "name"_a, "obj"_a, "api"_a, "replace"_a = false,
           "timeout"_a = 0.0)
      .def("delete",
           [](PyClient& self, const std::string& name) {
             absl::Status status;
             {
               nb::gil_scoped_release release;
               status = self.client->Delete(name);
             }
             Check(status);
           })
      .def("list", &ListDicts, "prefix"_a = "")
      .def("stat", &StatDict)
      .def("flush",
           [](PyClient& self) {
             absl::Status status;
             {
               nb::gil_scoped_release release;
               status = self.client->Flush();
             }
             Check(status);
           })
      .def_prop_ro("session_id", [](const PyClient& self) { return self.client->session_id(); });

  m.def("_after_fork_in_child", &ForgetAllocatorClientAfterFork,
        "Called in a child of os.fork(): forgets the parent's allocator client.");
  m.def("_exchange_api_calls", [] {
    const std::array<int64_t, 5> calls = ExchangeApiCalls();
    nb::dict out;
    const char* names[] = {"managed_tensor_allocator", "managed_tensor_from_py_object_no_sync",
                           "managed_tensor_to_py_object_no_sync", "dltensor_from_py_object_no_sync",
                           "current_work_stream"};
    for (int i = 0; i < 5; ++i) out[names[i]] = calls[i];
    return out;
  });
  m.def("_dtype_fields", [](const std::string& name) {
    DLDataType dtype = Check(tensorshm::ParseDataType(name));
    return std::make_tuple(static_cast<int>(dtype.code), static_cast<int>(dtype.bits),
                           static_cast<int>(dtype.lanes));
  });
  m.def("_dtype_name", [](int code, int bits, int lanes) {
    DLDataType dtype = Check(tensorshm::MakeDataType(code, bits, lanes));
    return tensorshm::DataTypeName(dtype);
  });
}
