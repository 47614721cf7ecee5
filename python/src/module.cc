// tensorshm._tensorshm: the nanobind extension under the `tensorshm` Python package. Registration
// only; each concept has its own file: tensor_binding (Tensor, WritableTensor), dlpack_export
// (__dlpack__), buffer_protocol, arrow (the Arrow PyCapsule interface), client_binding (_Client),
// put (copying other libraries' tensors in), waits (the GIL, signals, close and exit), and
// exchange_api (the DLPack C exchange API).
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "client_binding.h"
#include "exchange_api.h"
#include "tensor_binding.h"
#include "tensor_object.h"
#include "waits.h"

namespace nb = nanobind;

NB_MODULE(_tensorshm, m) {
  using namespace tensorshm::python;
  m.doc() = "tensorshm's native layer; use the `tensorshm` package.";
  // CMake's project VERSION (the one version of tensorshm), as tensorshm.__version__.
  m.attr("__version__") = TENSORSHM_VERSION;

  DefineTensors(m);
  DefineWaits(m);
  DefineClient(m);

  m.def("_quiet_leak_warnings", &QuietLeakWarnings,
        "At exit, when daemon threads are still alive: nanobind would report the tensors and "
        "clients they hold as leaked. Safe to leave: the process is exiting, and the daemon "
        "takes a session's leases and buffers back when its connection closes.");
  m.def("_after_fork_in_child", &ForgetAllocatorClientAfterFork,
        "Called in a child of os.fork(): forgets the parent's allocator client.");
  m.def("_exchange_api_calls", &ExchangeApiCallsByName);
  m.def("_dtype_fields", &DtypeFields);
  m.def("_dtype_name", &DtypeName);
  m.def("_triton_datatypes", &TritonDatatypes);
}
