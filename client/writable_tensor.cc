#include "client/writable_tensor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/client_core.h"
#include "client/fork.h"
#include "client/lease.h"
#include "client/public_status.h"
#include "client/segment_map.h"

namespace tensorshm {

void WritableTensorState::SetHostBuffer(const HostBuffer& buffer, const v1::Location& location) {
  segment_mapping = buffer.segment;
  buffer_address = buffer.data;
  buffer_length = location.length();
  segment_instance = location.segment_instance();
  segment_id = location.segment_id();
  segment_size = location.segment_size();
  buffer_offset = location.offset();
}

void WritableTensorState::SetTensor(void* data, DLDevice device, DLDataType dtype,
                                    std::vector<int64_t> new_shape,
                                    std::vector<int64_t> new_strides, uint64_t byte_offset,
                                    int64_t new_nbytes, uint64_t new_flags) {
  shape = std::move(new_shape);
  strides = std::move(new_strides);
  nbytes = new_nbytes;
  flags = new_flags;
  tensor.data = data;
  tensor.device = device;
  tensor.dtype = dtype;
  tensor.byte_offset = byte_offset;
  PointAtShape();
}
namespace {

// What a moved-from tensor shows.
const DLTensor kNoTensor{};

// Lets go of a writable tensor: frees its buffer if unpublished.
void Drop(std::unique_ptr<WritableTensorState> state) {
  if (state == nullptr) return;
  state->tensor.data = nullptr;
  state->segment_mapping.reset();
  if (state->cuda_writable && state->core != nullptr && !state->core->forked()) {
    // Given up unpublished: the buffer goes back to the pool, read-only here again.
    state->core->cuda()
        .Seal(state->cuda_ordinal,
              SegmentKey{state->cuda_place.segment_instance, state->cuda_place.segment_id},
              state->cuda_place.offset, state->cuda_length, /*ready_event=*/"")
        .IgnoreError();
  }
  if (state->core != nullptr && state->core->forked()) {
    // The parent's tensor: the child drops its own mapping and nothing else.
    KeepForever(std::move(state->core));
  } else if (state->core != nullptr && !state->published) {
    state->core->QueueAbandon(state->key);
  }
}

}  // namespace

WritableTensor::WritableTensor(std::unique_ptr<WritableTensorState> state)
    : state_(std::move(state)) {}

WritableTensor::WritableTensor(WritableTensor&& other) noexcept = default;

WritableTensor& WritableTensor::operator=(WritableTensor&& other) noexcept {
  if (this == &other) return *this;
  Drop(std::move(state_));
  state_ = std::move(other.state_);
  return *this;
}

WritableTensor::~WritableTensor() { Drop(std::move(state_)); }

const DLTensor& WritableTensor::dl_tensor() const {
  return state_ == nullptr ? kNoTensor : state_->tensor;
}

void* WritableTensor::data() const {
  if (state_ == nullptr || state_->tensor.data == nullptr) return nullptr;
  return static_cast<char*>(state_->tensor.data) + state_->tensor.byte_offset;
}

uint64_t WritableTensor::tensor_id() const { return state_ == nullptr ? 0 : state_->tensor_id; }

int64_t WritableTensor::nbytes() const { return state_ == nullptr ? 0 : state_->nbytes; }

uint64_t WritableTensor::dlpack_flags() const { return state_ == nullptr ? 0 : state_->flags; }

void* WritableTensor::buffer_address() const {
  return state_ == nullptr ? nullptr : state_->buffer_address;
}

bool WritableTensor::published() const { return state_ != nullptr && state_->published; }

Status WritableTensor::SealViews() {
  if (state_ == nullptr || !state_->published) {
    return Status(StatusCode::kFailedPrecondition,
                  absl::StrCat("tensor ", tensor_id(), ": SealViews before Publish"));
  }
  const WritableTensorState& state = *state_;
  if (state.segment_mapping == nullptr || state.buffer_length == 0) return Status();
  return ToPublic(
      state.segment_mapping->Seal(static_cast<uint64_t>(static_cast<char*>(state.buffer_address) -
                                                        state.segment_mapping->address()),
                                  state.buffer_length));
}

absl::StatusOr<SegmentPlace> PlaceOf(const WritableTensor& tensor) {
  const WritableTensorState* state = WritableTensorState::Of(tensor);
  if (state == nullptr) return absl::FailedPreconditionError("tensor: moved from");
  if (state->segment_mapping == nullptr) return state->cuda_place;  // CUDA, or empty
  const WritableSegment& segment = *state->segment_mapping;
  return HostPlace(*state->core, segment.key(), segment.shm_name(), segment.address(),
                   segment.size(), static_cast<const char*>(state->buffer_address));
}

}  // namespace tensorshm
