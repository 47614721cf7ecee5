// tensorshm._tensorshm._Client, which tensorshm.Client wraps: connect, get, create, delete,
// list, stat, sessions, flush and close (put_* come from put.h, arrow_to_dlpack from arrow.h).
#ifndef TENSORSHM_PYTHON_CLIENT_BINDING_H_
#define TENSORSHM_PYTHON_CLIENT_BINDING_H_

#include <nanobind/nanobind.h>

namespace tensorshm::python {

// Registers _Client on `m`.
void DefineClient(nanobind::module_& m);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_CLIENT_BINDING_H_
