// tensorshm tensors exported through the Arrow PyCapsule interface (the C Data Interface and the
// C Device Data Interface) as the canonical extension type arrow.fixed_shape_tensor, zero-copy:
// the lease is held until Arrow releases the array.
#ifndef TENSORSHM_PYTHON_ARROW_EXPORT_H_
#define TENSORSHM_PYTHON_ARROW_EXPORT_H_

#include <nanobind/nanobind.h>

#include "tensor_object.h"

namespace tensorshm::python {

// Adds __arrow_c_schema__, __arrow_c_array__ and __arrow_c_device_array__ to tensorshm.Tensor.
void DefineArrowExports(nanobind::class_<PyTensor>& tensor);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_ARROW_EXPORT_H_
