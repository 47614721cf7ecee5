// Copying a DLPack tensor from another library into a new tensorshm buffer.
#ifndef TENSORSHM_PYTHON_COPY_IN_H_
#define TENSORSHM_PYTHON_COPY_IN_H_

#include <dlpack/dlpack.h>

#include "absl/status/statusor.h"
#include "tensorshm/client.h"

namespace tensorshm::python {

// Allocates a C-contiguous tensorshm tensor with `source`'s dtype and shape through `client` and
// copies `source` (any strides, CPU memory) into it. `flags` are the source's DLPack flags
// (IS_SUBBYTE_TYPE_PADDED is kept). INVALID_ARGUMENT for a dtype tensorshm does not store or a
// packed sub-byte source that is not contiguous; FAILED_PRECONDITION for non-CPU memory; errors
// of Client::Create. Safe without the GIL as long as `source` stays valid.
// CUDA sources (contiguous only) are copied device to device on `stream`, on the same device.
// `timeout`: how long the create may wait for memory in a full pool (see Client::Create);
// `cancel`, if given, ends that wait.
tensorshm::StatusOr<WritableTensor> CopyIn(Client& client, const DLTensor& source, uint64_t flags,
                                           CudaStream stream = kLegacyDefaultStream,
                                           absl::Duration timeout = absl::ZeroDuration(),
                                           const WaitCanceller* cancel = nullptr);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_COPY_IN_H_
