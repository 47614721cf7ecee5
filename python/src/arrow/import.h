// Arrow arrays of the canonical extension type arrow.fixed_shape_tensor imported for Client.put:
// a DLPack view over the Arrow array, copied in as any DLPack tensor.
#ifndef TENSORSHM_PYTHON_ARROW_IMPORT_H_
#define TENSORSHM_PYTHON_ARROW_IMPORT_H_

#include <nanobind/nanobind.h>

#include "tensor_object.h"

namespace tensorshm::python {

// Adds _Client.arrow_to_dlpack(schema_capsule, array_capsule): takes the Arrow array (an
// "arrow_array" or "arrow_device_array" capsule, moved out of it) of type arrow.fixed_shape_tensor
// and returns a "dltensor_versioned" capsule viewing its values as a tensor of shape
// (length, *shape), which releases the Arrow array when its deleter runs. A CUDA array's
// sync_event is waited for on the legacy default stream first (the stream put copies on).
void DefineArrowImport(nanobind::class_<PyClient>& client);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_ARROW_IMPORT_H_
