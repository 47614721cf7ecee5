// Client's publishes: seals a writable tensor and binds it to a name, with a lease on it when
// asked (PublishAndAcquire).
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/calls.h"
#include "client/client_core.h"
#include "client/fast_path.h"
#include "client/lease.h"
#include "client/public_status.h"
#include "client/writable_tensor.h"
#include "common/tensor/name.h"
#include "common/tensor/wire.h"
#include "tensorshm/client.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {
namespace {

// Publish, filling *acquired (when not null) with the lease the daemon took in the same step.
absl::Status PublishTensor(ClientCore& core, WritableTensor& writable, std::string_view name,
                           bool replace, CudaStream ready_stream, v1::AcquireResponse* acquired) {
  if (absl::Status s = core.CheckProcess(); !s.ok()) return s;
  WritableTensorState* state = WritableTensorState::Of(writable);
  if (state == nullptr || state->published || state->core == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor ", state == nullptr ? 0 : state->tensor_id, ": already published or moved from"));
  }
  WritableTensorState& tensor = *state;
  if (tensor.core.get() != &core) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", tensor.tensor_id, ": created by another client"));
  }
  if (absl::Status s = ValidateName(View(name)); !s.ok()) return s;
  v1::ChannelRequest call;
  v1::PublishRequest& request = *call.mutable_publish();
  request.set_tensor_id(tensor.tensor_id);
  request.set_name(std::string(name));
  request.set_replace(replace);
  request.set_acquire(acquired != nullptr);
  if (tensor.stocked) {
    v1::TensorDesc* desc = request.mutable_desc();
    ToWire(tensor.tensor.dtype, desc->mutable_dtype());
    desc->mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
    desc->mutable_strides()->Assign(tensor.strides.begin(), tensor.strides.end());
    desc->set_flags(tensor.flags);
  }
  if (tensor.tensor.device.device_type == kDLCPU) {
    request.set_stock(core.stock().Wanted(tensor.buffer_length));
    request.set_stock_bytes(tensor.buffer_length);
  }
  if (tensor.tensor.device.device_type == kDLCUDA) {
    // Acquirers wait for what was issued on the producer's stream up to here.
    absl::StatusOr<std::string> event = core.cuda().RecordReadyEvent(
        tensor.tensor.device.device_id, static_cast<CUstream>(ready_stream), tensor.tensor_id);
    if (!event.ok()) return event.status();
    request.set_ready_event(*event);
  }
  v1::PublishResponse response;
  // Sent once: a publish whose session ended meanwhile has an unknown fate (CallAcrossRestart).
  if (absl::Status s = core.CallAcrossRestart(
          absl::StrCat("publish of tensor ", tensor.tensor_id, " as name = \"", View(name), "\""),
          ClientCore::RestartDeadline(kCallTimeout), /*repeatable=*/false, nullptr,
          [&] {
            // Refused if a restarted daemon did not take the tensor back: its id may name
            // another now.
            if (absl::Status s = core.UnpublishedId(tensor.key).status(); !s.ok()) return s;
            return ChannelOrRpc(core, call, &v1::ChannelResponse::mutable_published,
                                &v1::TensorShm::Stub::Publish, request, &response);
          });
      !s.ok()) {
    return s;
  }
  core.AddStock(response.stocked());
  tensor.tensor.data = nullptr;  // sealed: no writable pointer from here on
  tensor.published = true;
  if (tensor.cuda_writable) {
    // The producer's writable mapping ends with the publish, once the stream's writes are done.
    // A failure leaves the pieces writable in this process only; the publish stands.
    tensor.cuda_writable = false;
    core.cuda()
        .Seal(tensor.cuda_ordinal,
              SegmentKey{tensor.cuda_place.segment_instance, tensor.cuda_place.segment_id},
              tensor.cuda_place.offset, tensor.cuda_length, request.ready_event())
        .IgnoreError();
  }
  core.Published(tensor.key);
  if (tensor.tensor.device.device_type == kDLCUDA) core.SweepReadyEvents();
  if (acquired != nullptr) *acquired = std::move(*response.mutable_acquired());
  return absl::OkStatus();
}

absl::StatusOr<DLManagedTensorVersioned*> PublishAndLease(const std::shared_ptr<ClientCore>& core,
                                                          WritableTensor& tensor,
                                                          std::string_view name, bool replace,
                                                          CudaStream ready_stream) {
  // A host tensor is leased through the lease page: the slot is taken before the publish, so
  // that nothing can free the tensor between its publish and the lease, and no RPC lease is
  // needed. (A CUDA tensor, or no free slot: the daemon takes the lease in the publish.)
  // Before the slot: a fork child must not write into its parent's lease page.
  if (absl::Status s = core->CheckProcess(); !s.ok()) return s;
  std::shared_ptr<FastPath> fast = core->fast_path();
  uint32_t page_slot = 0;
  const WritableTensorState* state = WritableTensorState::Of(tensor);
  if (fast != nullptr && state != nullptr && state->core == core && !state->published &&
      state->tensor.device.device_type == kDLCPU && fast->Pin(state->tensor_id, &page_slot)) {
    core->PageLeaseTaken();
    auto lease = std::make_unique<Lease>();
    lease->core = core;
    lease->held = PageLease{fast, page_slot};
    const char* data = kEmptyData;
    if (state->buffer_length > 0) {
      absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping = core->mappings().HostSegment(
          SegmentKey{state->segment_instance, state->segment_id}, state->segment_size,
          state->buffer_offset, state->buffer_length);
      if (!mapping.ok()) {
        lease->GiveBack();
        return mapping.status();
      }
      data = (*mapping)->address() + state->buffer_offset;
      lease->bytes = HostBytes{*std::move(mapping)};
    }
    lease->shape = state->shape;
    lease->strides = state->strides;
    FillTensor(*lease, data, state->tensor.device, state->tensor.dtype, state->tensor.byte_offset,
               state->flags);
    if (absl::Status s = PublishTensor(*core, tensor, name, replace, ready_stream, nullptr);
        !s.ok()) {
      lease->GiveBack();
      return s;
    }
    return HandOut(std::move(lease));
  }
  v1::AcquireResponse acquired;
  if (absl::Status s = PublishTensor(*core, tensor, name, replace, ready_stream, &acquired);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<std::unique_ptr<Lease>> lease = MakeLease(core, acquired);
  if (!lease.ok()) return lease.status();
  return HandOut(*std::move(lease));
}

}  // namespace

Status Client::Publish(WritableTensor& tensor, std::string_view name, bool replace,
                       CudaStream ready_stream) {
  return ToPublic(PublishTensor(*core_, tensor, name, replace, ready_stream, nullptr));
}

StatusOr<DLManagedTensorVersioned*> Client::PublishAndAcquire(WritableTensor& tensor,
                                                              std::string_view name, bool replace,
                                                              CudaStream ready_stream) {
  return ToPublic(PublishAndLease(core_, tensor, name, replace, ready_stream));
}

}  // namespace tensorshm
