// The buffer protocol (memoryview, np.asarray) for tensorshm.Tensor, and the raw-bytes object
// tensorshm.to_numpy views dtypes through that the protocol cannot name.
#ifndef TENSORSHM_PYTHON_BUFFER_PROTOCOL_H_
#define TENSORSHM_PYTHON_BUFFER_PROTOCOL_H_

#include <Python.h>

#include <memory>

#include "storage.h"

namespace tensorshm::python {

// The bytes of a tensor's storage, 1-d, for building numpy views of dtypes the buffer protocol
// cannot name (ml_dtypes).
struct RawStorage {
  std::shared_ptr<Storage> storage;
};

// Type slots (Py_bf_getbuffer, Py_bf_releasebuffer) for nb::type_slots: of tensorshm.Tensor (its
// shape, strides and format; a released tensor raises ReleasedError) and of _RawStorage (the
// storage's bytes as 1-d unsigned bytes). A view holds the storage, so it stays valid after the
// tensor's release().
const PyType_Slot* TensorBufferSlots();
const PyType_Slot* RawStorageBufferSlots();

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_BUFFER_PROTOCOL_H_
