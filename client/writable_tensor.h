// What a WritableTensor holds (include/tensorshm/client.h shows only a pointer to it). Private to
// the client library.
#ifndef TENSORSHM_CLIENT_WRITABLE_TENSOR_H_
#define TENSORSHM_CLIENT_WRITABLE_TENSOR_H_

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "client/client_core.h"
#include "client/interop.h"
#include "tensorshm/client.h"

namespace tensorshm {

class WritableSegment;

// A writable tensor's state. Not thread-safe (as WritableTensor).
class WritableTensorState {
 public:
  // A WritableTensor holding `state`.
  static WritableTensor Wrap(std::unique_ptr<WritableTensorState> state) {
    return WritableTensor(std::move(state));
  }
  // `tensor`'s state; nullptr for a moved-from tensor.
  static WritableTensorState* Of(WritableTensor& tensor) { return tensor.state_.get(); }
  static const WritableTensorState* Of(const WritableTensor& tensor) { return tensor.state_.get(); }

  // The one place a writable tensor's state is filled in, whichever way its buffer came (the
  // daemon's answer to a create, or a stocked buffer):
  // its host buffer, `buffer` in this process's writable mapping of the segment, lying where
  // `location` says...
  void SetHostBuffer(const HostBuffer& buffer, const v1::Location& location);
  // ... and its DLPack description, the data at `data` (the buffer's address, a CUDA pointer,
  // or kEmptyData).
  void SetTensor(void* data, DLDevice device, DLDataType dtype, std::vector<int64_t> shape,
                 std::vector<int64_t> strides, uint64_t byte_offset, int64_t nbytes,
                 uint64_t flags);

  // Points tensor.shape and tensor.strides at shape and strides (after either moved).
  void PointAtShape() {
    tensor.ndim = static_cast<int32_t>(shape.size());
    tensor.shape = shape.data();
    tensor.strides = strides.data();
  }

  std::shared_ptr<ClientCore> core;
  uint64_t tensor_id = 0;
  uint64_t key = 0;  // the core's key for it while unpublished
  DLTensor tensor{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  // The segment's writable mapping (host buffers), kept alive by this tensor; the buffer's
  // address and page-rounded length in it.
  std::shared_ptr<WritableSegment> segment_mapping;
  void* buffer_address = nullptr;
  size_t buffer_length = 0;
  int64_t nbytes = 0;
  uint64_t flags = 0;
  bool published = false;
  bool stocked = false;  // made from a buffer the daemon stocked: Publish sends the descriptor
  // Host tensors: where the buffer lies, for a lease on it after publish.
  uint64_t segment_instance = 0;
  uint64_t segment_id = 0;
  uint64_t segment_size = 0;
  uint64_t buffer_offset = 0;
  // CUDA tensors: where the buffer lies (PlaceOf; host buffers: from segment_mapping).
  SegmentPlace cuda_place;
  // A VMM buffer this process made writable (CudaState::MakeWritable): sealed at publish, or
  // when the tensor is given up.
  bool cuda_writable = false;
  int cuda_ordinal = 0;
  uint64_t cuda_length = 0;  // the buffer's length (from cuda_place.offset)
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_WRITABLE_TENSOR_H_
