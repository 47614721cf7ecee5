// Hashes of a tensor's bytes, for comparing tensors across processes.
#ifndef TENSORSHM_TESTS_SUPPORT_TENSOR_BYTES_H_
#define TENSORSHM_TESTS_SUPPORT_TENSOR_BYTES_H_

#include <dlpack/dlpack.h>

#include <cstdint>

namespace tensorshm::testing {

// FNV-1a of every byte of the storage the tensor spans: [data, data + nbytes), where nbytes and
// the start follow from shape, strides and dtype (ComputeLayout).
uint64_t StorageHash(const DLTensor& tensor);

// FNV-1a of the elements in logical (row-major index) order, read through the strides; equal
// for two tensors with the same values whatever their layouts. Sub-byte dtypes: StorageHash.
uint64_t LogicalHash(const DLTensor& tensor);

}  // namespace tensorshm::testing

#endif  // TENSORSHM_TESTS_SUPPORT_TENSOR_BYTES_H_
