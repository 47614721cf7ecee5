#include "common/shm/tensor_record.h"

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/tensor/dtype.h"

namespace tensorshm {

void CopyRecord(const TensorRecord& shared, TensorRecord& local) {
  std::memcpy(static_cast<void*>(&local), static_cast<const void*>(&shared), sizeof(TensorRecord));
  // A compiler barrier: without it the compiler may drop the copy and read `shared` wherever
  // `local` is used, seeing values that changed after they were checked.
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

void CopyRecord(const SegmentRecord& shared, SegmentRecord& local) {
  std::memcpy(static_cast<void*>(&local), static_cast<const void*>(&shared), sizeof(SegmentRecord));
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

absl::StatusOr<RecordLayout> DecodeRecordLayout(const TensorRecord& copy) {
  absl::StatusOr<DLDataType> dtype =
      MakeDataType(copy.dtype_code, copy.dtype_bits, copy.dtype_lanes, "record dtype");
  if (!dtype.ok()) return absl::DataLossError(dtype.status().message());
  if (copy.ndim < 0 || copy.ndim > static_cast<int32_t>(kRecordMaxDims)) {
    return absl::DataLossError(
        absl::StrCat("record ndim = ", copy.ndim, ": not in [0, ", kRecordMaxDims, "]"));
  }
  const bool padded = copy.dlpack_flags == DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED;
  if (copy.dlpack_flags != 0 && !padded) {
    return absl::DataLossError(
        absl::StrCat("record dlpack_flags = ", copy.dlpack_flags, ": unknown flags"));
  }
  RecordLayout decoded;
  decoded.dtype = *dtype;
  decoded.subbyte_padded = padded;
  decoded.shape.assign(copy.shape, copy.shape + copy.ndim);
  absl::StatusOr<TensorLayout> layout =
      ComputeLayout(*dtype, decoded.shape, absl::MakeConstSpan(copy.strides, copy.ndim), padded);
  if (!layout.ok()) return absl::DataLossError(layout.status().message());
  if (layout->nbytes != copy.nbytes || layout->byte_offset != copy.byte_offset) {
    return absl::DataLossError(absl::StrCat(
        "record nbytes = ", copy.nbytes, ", byte_offset = ", copy.byte_offset,
        ": the shape and strides span ", layout->nbytes, " bytes at offset ", layout->byte_offset));
  }
  // Every element lies in [0, nbytes) of the buffer (byte_offset < nbytes when non-zero).
  if (static_cast<uint64_t>(layout->nbytes) > copy.length) {
    return absl::DataLossError(absl::StrCat("record nbytes = ", copy.nbytes,
                                            ": more than the buffer's length ", copy.length));
  }
  decoded.layout = *std::move(layout);
  return decoded;
}

}  // namespace tensorshm
