// tensorshm.Tensor.__dlpack__: DLPack capsules of a tensor (versioned views, legacy capsules,
// host copies), following the DLPack stream and copy rules.
#ifndef TENSORSHM_PYTHON_DLPACK_EXPORT_H_
#define TENSORSHM_PYTHON_DLPACK_EXPORT_H_

#include <nanobind/nanobind.h>

#include "tensor_object.h"

namespace tensorshm::python {

// The PyCapsule names DLPack gives a capsule before and after a consumer took it.
inline constexpr char kVersioned[] = "dltensor_versioned";
inline constexpr char kUsedVersioned[] = "used_dltensor_versioned";
inline constexpr char kLegacy[] = "dltensor";
inline constexpr char kUsedLegacy[] = "used_dltensor";

// `self.__dlpack__(stream=, max_version=, dl_device=, copy=)`: a "dltensor_versioned" capsule
// when max_version >= (1, 0), else a legacy "dltensor" one (a private host copy of a read-only
// host tensor, since a legacy capsule cannot say read-only). Raises ValueError for a stream the
// DLPack rules refuse, BufferError for a device or copy request it cannot serve. A CUDA view
// orders the consumer's stream after the tensor's ready event (waited for without the GIL).
// `self` holds its own reference to the storage (a release() in another thread meanwhile cannot
// free it). REQUIRES the GIL.
nanobind::object DLPack(PyTensor& self, nanobind::handle stream, nanobind::handle max_version,
                        nanobind::handle dl_device, nanobind::handle copy);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_DLPACK_EXPORT_H_
