#include "dlpack_export.h"

#include <nanobind/stl/pair.h>

#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/tensor/dtype.h"
#include "common/tensor/wire.h"
#include "raise_status.h"
#include "storage.h"
#include "waits.h"

namespace nb = nanobind;

namespace tensorshm::python {
namespace {

[[noreturn]] void RaiseBufferError(const std::string& message) {
  PyErr_SetString(PyExc_BufferError, message.c_str());
  throw nb::python_error();
}

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

}  // namespace

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
    Status s;
    {
      ReleaseGil release;
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

}  // namespace tensorshm::python
