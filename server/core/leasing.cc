#include "server/core/leasing.h"

#include "server/memory/cuda_pool.h"

namespace tensorshm {

DecodedTensor Leasing::DescriptionOf(const Tensor& tensor) {
  return DecodedTensor{
      .dtype = tensor.dtype,
      .device = tensor.device,
      .shape = tensor.shape,
      .strides = tensor.strides,
      .byte_offset = tensor.byte_offset,
      .nbytes = tensor.nbytes,
      .flags = tensor.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : uint64_t{0}};
}

TensorPlace Leasing::PlaceOf(const Tensor& tensor) const {
  TensorPlace place{.segment_id = tensor.buffer.segment_id,
                    .offset = tensor.buffer.offset,
                    .length = tensor.buffer.length,
                    // CUDA segments are always this daemon's own (device memory does not survive
                    // it).
                    .segment_instance = catalog_.instance_id()};
  if (tensor.device.device_type == kDLCUDA) {
    const CudaPool* pool = catalog_.cuda_pool(tensor.device.device_id);
    CudaPlace& cuda = place.cuda.emplace();
    cuda.ordinal = pool->ordinal();
    cuda.uuid.assign(reinterpret_cast<const char*>(pool->uuid().data()), pool->uuid().size());
    if (tensor.buffer.length > 0) {
      place.segment_size = pool->SegmentSize(tensor.buffer.segment_id);
      if (pool->kind() == CudaPoolKind::kVmm) {
        cuda.vmm = true;  // its descriptor comes over the memory channel
      } else {
        const CUipcMemHandle& handle = pool->SegmentHandle(tensor.buffer.segment_id);
        cuda.ipc_handle.assign(handle.reserved, sizeof(handle.reserved));
      }
    }
    if (tensor.sealed) cuda.ready_event = tensor.ready_event;
  } else if (tensor.buffer.length > 0) {
    const HostPool& pool = catalog_.host_pool();
    place.segment_size = pool.SegmentSize(tensor.buffer.segment_id);
    place.segment_instance = pool.SegmentInstance(tensor.buffer.segment_id);
    // Each segment's own backing: a pool of named segments gives other uids memfd ones.
    const ShmSegment& segment = pool.Segment(tensor.buffer.segment_id);
    place.shm_name = segment.backing() == SegmentBacking::kNamed ? segment.name() : "";
  }
  return place;
}

LeaseGrant Leasing::Grant(Session& session, const Tensor& tensor) {
  return LeaseGrant{.lease_id = AddLease(session, tensor),
                    .tensor_id = tensor.id,
                    .desc = DescriptionOf(tensor),
                    .place = PlaceOf(tensor)};
}

uint64_t Leasing::AddLease(Session& session, const Tensor& tensor) {
  const uint64_t lease = sessions_.NextLeaseId();
  session.leases.emplace(lease, tensor.id);
  catalog_.AddLease(tensor.id);
  return lease;
}

bool Leasing::DropLease(Session& session, uint64_t lease_id) {
  auto lease = session.leases.find(lease_id);
  if (lease == session.leases.end()) return false;
  catalog_.DropLease(lease->second);
  session.leases.erase(lease);
  session.uid_charge.DropLeases();
  return true;
}

void Leasing::GiveBack(Session& session, const Session::RequestGrant& grant) {
  DropLease(session, grant.lease_id);
  for (uint64_t tensor_id : grant.tensor_ids) {
    if (session.unpublished.count(tensor_id) == 0) continue;  // published, or dropped already
    if (catalog_.Abandon(session.id, tensor_id).ok()) session.ForgetUnpublished(tensor_id);
  }
}

std::vector<uint64_t> Leasing::IdsOf(const Created& created) {
  std::vector<uint64_t> ids = {created.tensor_id};
  for (const Stocked& stocked : created.stocked) ids.push_back(stocked.tensor_id);
  return ids;
}

absl::Status Leasing::KeepCreated(const std::string& token, const absl::Status& gone,
                                  uint64_t request_id, const Created& created) {
  if (request_id == 0) return absl::OkStatus();
  Session* session = sessions_.Find(token);
  if (session == nullptr) return gone;  // its unpublished tensors went with it
  if (!session->TakeSettled(request_id)) {
    session->RecordGrant(request_id, {0, IdsOf(created)});
    return absl::OkStatus();
  }
  // Settled while its segment was being made: nobody will take these buffers.
  GiveBack(*session, {0, IdsOf(created)});
  return absl::CancelledError("create: settled (cancelled) by the client");
}

}  // namespace tensorshm
