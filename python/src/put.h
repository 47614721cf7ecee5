// _Client.put_capsule and _Client.put_exchange: copying another library's tensor (a DLPack
// capsule, or an object with the DLPack C exchange API) into a new tensor and publishing it.
#ifndef TENSORSHM_PYTHON_PUT_H_
#define TENSORSHM_PYTHON_PUT_H_

#include <nanobind/nanobind.h>

#include <optional>
#include <string>

#include "tensor_object.h"
#include "tensorshm/client.h"

namespace tensorshm::python {

// Consumes `capsule` ("dltensor_versioned" or "dltensor", renamed used_* as DLPack says), copies
// its tensor into a new tensor, publishes it as `name` and returns it holding a lease. `timeout`
// as _Client.create's; `cancel` wakes that wait. Raises ValueError for a capsule already
// consumed or of another DLPack major version, TypeError for anything else.
PyTensor PutCapsule(PyClient& self, const std::string& name, nanobind::handle capsule, bool replace,
                    const std::optional<double>& timeout,
                    const std::optional<WaitCanceller>& cancel);

// As PutCapsule, for `obj` exporting `api_object` (its type's __dlpack_c_exchange_api__, a
// "dlpack_exchange_api" capsule or an int). Without a wait for memory the non-owning view is
// copied with the GIL held; a waiting put takes the owning export and waits without the GIL.
PyTensor PutExchange(PyClient& self, const std::string& name, nanobind::handle obj,
                     nanobind::handle api_object, bool replace,
                     const std::optional<double>& timeout);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_PUT_H_
