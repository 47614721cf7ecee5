// Reading a TensorRecord (common/shm/catalog_layout.h) that another process may be writing: the
// control segment is shared memory any process of the daemon's uid can open read-write, so
// neither the daemon nor a client trusts a record in place. Both copy it out once and check the
// copy; every later use reads the copy.
#ifndef TENSORSHM_COMMON_SHM_TENSOR_RECORD_H_
#define TENSORSHM_COMMON_SHM_TENSOR_RECORD_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/shm/catalog_layout.h"
#include "common/tensor/layout.h"

namespace tensorshm {

// Copies `shared` (a record in shared memory) into `local`. The copy may be torn when a writer
// is busy: what matters is that every later check and use reads `local`, which no other process
// can change (the compiler is kept from reading `shared` again in its place).
void CopyRecord(const TensorRecord& shared, TensorRecord& local);
// The same for a segment's record.
void CopyRecord(const SegmentRecord& shared, SegmentRecord& local);

// What a record's layout fields describe, once checked.
struct RecordLayout {
  DLDataType dtype{};
  std::vector<int64_t> shape;
  TensorLayout layout;  // resolved strides, byte offset and span
  bool subbyte_padded = false;
};

// Checks the layout fields of a copied record: a dtype tensorshm accepts, 0 <= ndim <= 32,
// dlpack_flags 0 or IS_SUBBYTE_TYPE_PADDED, shape and strides that ComputeLayout accepts and
// whose byte offset and span are the recorded `byte_offset` and `nbytes`, and a span that fits
// the recorded buffer `length`. DATA_LOSS naming the first field that fails, and its value.
absl::StatusOr<RecordLayout> DecodeRecordLayout(const TensorRecord& copy);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_SHM_TENSOR_RECORD_H_
