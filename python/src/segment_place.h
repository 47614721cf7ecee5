// Tensor.segment_place(): where a tensor's bytes lie in the daemon's memory, for modules that
// register segments with a server that maps them itself (tensorshm.triton).
#ifndef TENSORSHM_PYTHON_SEGMENT_PLACE_H_
#define TENSORSHM_PYTHON_SEGMENT_PLACE_H_

#include <nanobind/nanobind.h>

#include "tensor_object.h"

namespace tensorshm::python {

// A dict: "device" ("cpu" or "cuda"), "device_id" (this process's CUDA ordinal, 0 for host),
// "segment_instance" and "segment_id" (together, one memory object for good), "segment_size",
// "offset" and "nbytes" (the tensor's storage span in the segment), "shm_name" (host: the POSIX
// shm object's name, "" for a memfd segment) and "ipc_handle" (CUDA: the segment's 64-byte
// CUipcMemHandle, as bytes). Raises InvalidArgumentError for a tensor that is not in tensorshm
// memory (a foreign tensor) or is empty, ReleasedError once released.
nanobind::dict SegmentPlaceOf(const PyTensor& tensor);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_SEGMENT_PLACE_H_
