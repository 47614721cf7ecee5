#include "buffer_protocol.h"

#include <nanobind/nanobind.h>

#include <string>
#include <vector>

#include "common/tensor/dtype.h"
#include "common/tensor/wire.h"
#include "tensor_object.h"

namespace nb = nanobind;

namespace tensorshm::python {
namespace {

// What a Py_buffer's `internal` holds: its shape and strides, and the storage it views, so that
// the view stays valid when its tensor is released while the view lives.
struct BufferInternal {
  std::vector<Py_ssize_t> dims;
  std::shared_ptr<Storage> storage;
};

// Exports `storage_ptr`'s tensor as a Py_buffer on behalf of `owner`.
int ExportBuffer(PyObject* owner, const std::shared_ptr<Storage>& storage_ptr,
                 const std::string& what, Py_buffer* view, int flags, bool raw) {
  view->obj = nullptr;
  const Storage& storage = *storage_ptr;
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
  auto* holder = new BufferInternal{{}, storage_ptr};
  std::vector<Py_ssize_t>* internal = &holder->dims;
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
      delete holder;
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
      delete holder;
      return fail(what + " is not C-contiguous");
    }
    if ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS && !f_contiguous) {
      delete holder;
      return fail(what + " is not Fortran-contiguous");
    }
    if ((flags & PyBUF_ANY_CONTIGUOUS) == PyBUF_ANY_CONTIGUOUS && !c_contiguous && !f_contiguous) {
      delete holder;
      return fail(what + " is not contiguous");
    }
    if ((flags & PyBUF_STRIDES) != PyBUF_STRIDES && !c_contiguous) {
      delete holder;
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
  view->internal = holder;
  view->obj = owner;
  Py_INCREF(owner);
  return 0;
}

void ReleaseBuffer(PyObject*, Py_buffer* view) {
  delete static_cast<BufferInternal*>(view->internal);  // possibly the storage's last reference
}

int TensorGetBuffer(PyObject* self, Py_buffer* view, int flags) {
  const PyTensor* t = nb::inst_ptr<PyTensor>(nb::handle(self));
  const std::shared_ptr<Storage>* storage = LiveOrSetError(*t);
  if (storage == nullptr) {
    view->obj = nullptr;
    return -1;
  }
  return ExportBuffer(self, *storage, Describe(*t), view, flags, /*raw=*/false);
}

int RawGetBuffer(PyObject* self, Py_buffer* view, int flags) {
  const RawStorage* raw = nb::inst_ptr<RawStorage>(nb::handle(self));
  return ExportBuffer(self, raw->storage, "tensor storage", view, flags, /*raw=*/true);
}

PyType_Slot tensor_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(TensorGetBuffer)},
                              {Py_bf_releasebuffer, reinterpret_cast<void*>(ReleaseBuffer)},
                              {0, nullptr}};
PyType_Slot raw_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(RawGetBuffer)},
                           {Py_bf_releasebuffer, reinterpret_cast<void*>(ReleaseBuffer)},
                           {0, nullptr}};

}  // namespace

const PyType_Slot* TensorBufferSlots() { return tensor_slots; }
const PyType_Slot* RawStorageBufferSlots() { return raw_slots; }

}  // namespace tensorshm::python
