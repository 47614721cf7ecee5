#include "server/rpc/wire_calls.h"

#include <dlpack/dlpack.h>

#include <utility>
#include <variant>

#include "absl/status/status.h"
#include "common/tensor/wire.h"
#include "server/rpc/wire_results.h"

namespace tensorshm {
namespace {

// Writes one SegmentGranted as the message's SegmentGrant.
void ToWire(const SegmentGranted& grant, v1::SegmentGrant* out) {
  out->set_segment_id(grant.segment_id);
  out->set_segment_instance(grant.segment_instance);
  out->set_size(grant.size);
  out->set_writable(grant.writable);
  out->set_shm_name(grant.shm_name);
  out->set_granularity(grant.granularity);
}

void ToWire(const std::vector<Stocked>& stocked,
            google::protobuf::RepeatedPtrField<v1::StockedBuffer>* out) {
  out->Reserve(static_cast<int>(stocked.size()));
  for (const Stocked& buffer : stocked) {
    v1::StockedBuffer* added = out->Add();
    added->set_tensor_id(buffer.tensor_id);
    ToWire(buffer.place, added->mutable_location());
  }
}

}  // namespace

absl::StatusOr<CreateOrder> FromWire(const v1::CreateRequest& request) {
  absl::StatusOr<DLDataType> dtype = FromWire(request.dtype());
  if (!dtype.ok()) return dtype.status();
  return CreateOrder{
      .spec = {.dtype = *dtype,
               .shape = {request.shape().begin(), request.shape().end()},
               .strides = {request.strides().begin(), request.strides().end()},
               .subbyte_padded = request.subbyte_padded()},
      .device = request.has_device() ? FromWire(request.device()) : DLDevice{kDLCPU, 0},
      .device_uuid = request.device_uuid(),
      .stock = request.stock(),
      .wait_ms = request.wait_ms(),
      .request_id = request.request_id()};
}

void ToWire(const Created& created, v1::CreateResponse* out) {
  out->set_tensor_id(created.tensor_id);
  ToWire(created.desc, out->mutable_desc());
  ToWire(created.place, out->mutable_location());
  ToWire(created.stocked, out->mutable_stocked());
}

absl::StatusOr<PublishOrder> FromWire(const v1::PublishRequest& request) {
  PublishOrder order{.tensor_id = request.tensor_id(),
                     .name = request.name(),
                     .replace = request.replace(),
                     .acquire = request.acquire(),
                     .ready_event = request.ready_event(),
                     .stock = request.stock(),
                     .stock_bytes = request.stock_bytes()};
  if (request.has_desc()) {
    const v1::TensorDesc& desc = request.desc();
    absl::StatusOr<DLDataType> dtype = FromWire(desc.dtype());
    if (!dtype.ok()) return dtype.status();
    order.spec = TensorSpec{
        .dtype = *dtype,
        .shape = {desc.shape().begin(), desc.shape().end()},
        .strides = {desc.strides().begin(), desc.strides().end()},
        .subbyte_padded = (desc.flags() & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0};
  }
  return order;
}

void ToWire(const Published& published, v1::PublishResponse* out) {
  if (published.acquired.has_value()) ToWire(*published.acquired, out->mutable_acquired());
  ToWire(published.stocked, out->mutable_stocked());
}

AcquireOrder FromWire(const v1::AcquireRequest& request) {
  return AcquireOrder{
      .name = request.name(), .wait_ms = request.wait_ms(), .request_id = request.request_id()};
}

void ToWire(const LeaseGrant& lease, v1::AcquireResponse* out) {
  out->set_lease_id(lease.lease_id);
  out->set_tensor_id(lease.tensor_id);
  ToWire(lease.desc, out->mutable_desc());
  ToWire(lease.place, out->mutable_location());
}

void ToWire(const TensorPlace& place, v1::Location* out) {
  out->set_segment_id(place.segment_id);
  out->set_offset(place.offset);
  out->set_length(place.length);
  out->set_segment_size(place.segment_size);
  out->set_segment_instance(place.segment_instance);
  if (place.shm_name.has_value()) out->mutable_host()->set_shm_name(*place.shm_name);
  if (place.cuda.has_value()) {
    const CudaPlace& cuda = *place.cuda;
    v1::CudaLocation* wire = out->mutable_cuda();
    wire->set_device_ordinal(cuda.ordinal);
    wire->set_device_uuid(cuda.uuid);
    wire->set_vmm(cuda.vmm);
    wire->set_ipc_handle(cuda.ipc_handle);
    wire->set_ready_event(cuda.ready_event);
  }
}

absl::StatusOr<ChannelAsk> FromWire(const v1::ChannelRequest& request) {
  switch (request.kind_case()) {
    case v1::ChannelRequest::kBind:
      return ChannelBind{request.bind().session_id()};
    case v1::ChannelRequest::kSegment: {
      const v1::SegmentRequest& segment = request.segment();
      return SegmentAsk{.segment_id = segment.segment_id(),
                        .segment_instance = segment.segment_instance(),
                        .writable = segment.writable(),
                        .cuda = segment.cuda(),
                        .device_ordinal = segment.device_ordinal()};
    }
    case v1::ChannelRequest::kFastPath:
      return FastPathAsk{static_cast<int32_t>(request.fast_path().part())};
    case v1::ChannelRequest::kCreate: {
      absl::StatusOr<CreateOrder> order = FromWire(request.create());
      if (!order.ok()) return order.status();
      return *std::move(order);
    }
    case v1::ChannelRequest::kPublish: {
      absl::StatusOr<PublishOrder> order = FromWire(request.publish());
      if (!order.ok()) return order.status();
      return *std::move(order);
    }
    case v1::ChannelRequest::kDelete:
      return DeleteOrder{request.delete_().name()};
    case v1::ChannelRequest::kAcquire:
      return FromWire(request.acquire());
    case v1::ChannelRequest::kRelease:
      return FromWire(request.release());
    case v1::ChannelRequest::KIND_NOT_SET:
      return absl::InvalidArgumentError(
          "kind: not set (bind, segment, fast_path, create, publish, delete, acquire or cancel)");
    default:
      return absl::InvalidArgumentError("kind: not a request this daemon knows");
  }
}

void ToWire(const ChannelAnswer& answer, v1::ChannelResponse* out) {
  if (const auto* bound = std::get_if<ChannelBound>(&answer)) {
    out->mutable_bound()->set_instance_id(bound->instance_id);
  } else if (const auto* segment = std::get_if<SegmentGranted>(&answer)) {
    ToWire(*segment, out->mutable_segment());
  } else if (const auto* part = std::get_if<FastPathGranted>(&answer)) {
    v1::FastPathGrant* grant = out->mutable_fast_path();
    grant->set_part(static_cast<v1::FastPathRequest::Part>(part->part));
    grant->set_size(part->size);
    grant->set_instance_id(part->instance_id);
  } else if (const auto* created = std::get_if<ChannelCreated>(&answer)) {
    ToWire(created->created, out->mutable_created());
    if (created->attached.has_value()) ToWire(*created->attached, out->mutable_attached_segment());
  } else if (const auto* published = std::get_if<Published>(&answer)) {
    ToWire(*published, out->mutable_published());
  } else if (const auto* lease = std::get_if<LeaseGrant>(&answer)) {
    ToWire(*lease, out->mutable_acquired());
  } else if (const auto* done = std::get_if<ReleasesDone>(&answer)) {
    ToWire(*done, out->mutable_ack());
  } else {
    out->mutable_deleted();
  }
}

}  // namespace tensorshm
