#include "server/rpc/wire_results.h"

#include "common/tensor/wire.h"

namespace tensorshm {

void ToWire(const StoreFigures& figures, v1::StatResponse* out) {
  out->set_tensors(figures.tensors);
  out->set_names(figures.names);
  out->set_leases(figures.leases);
  out->set_sessions(figures.sessions);
  out->set_evicted_tensors(figures.evicted_tensors);
  out->set_evicted_bytes(figures.evicted_bytes);
  out->set_creates_waiting(figures.creates_waiting);
  out->set_stocked_tensors(figures.stocked_tensors);
  for (const PoolFigures& pool : figures.pools) {
    v1::PoolStats* stats = out->add_pools();
    ToWire(pool.device, stats->mutable_device());
    stats->set_capacity_bytes(pool.capacity_bytes);
    stats->set_used_bytes(pool.used_bytes);
    stats->set_stock_bytes(pool.stock_bytes);
    stats->set_segments(pool.segments);
    stats->set_largest_free_bytes(pool.largest_free_bytes);
  }
}

void ToWire(const std::vector<TensorListing>& listed, v1::ListResponse* out) {
  for (const TensorListing& entry : listed) {
    v1::TensorInfo* info = out->add_tensors();
    info->set_name(entry.name);
    info->set_tensor_id(entry.tensor_id);
    ToWire(entry.desc, info->mutable_desc());
    info->set_leases(entry.leases);
    info->set_published_unix_ms(entry.published_unix_ms);
    info->set_publisher_uid(entry.publisher_uid);
    info->set_publisher_pid(entry.publisher_pid);
  }
}

void ToWire(const std::vector<SessionListing>& listed, v1::SessionsResponse* out) {
  for (const SessionListing& entry : listed) {
    v1::SessionInfo* info = out->add_sessions();
    info->set_session_id(entry.session_id);
    info->set_uid(entry.uid);
    info->set_pid(entry.pid);
    info->set_gid(entry.gid);
    info->set_client_name(entry.client_name);
    info->set_client_version(entry.client_version);
    info->set_rpc_leases(entry.rpc_leases);
    info->set_page_leases(entry.page_leases);
    info->set_unpublished_tensors(entry.unpublished_tensors);
    info->set_unpublished_bytes(entry.unpublished_bytes);
    info->set_waiting_acquires(entry.waiting_acquires);
    info->set_opened_unix_ms(entry.opened_unix_ms);
    info->set_own(entry.own);
    info->set_redacted(entry.redacted);
  }
}

SessionOpening FromWire(const v1::SessionOpen& open) {
  return SessionOpening{
      .client_name = open.client_name(),
      .client_version = open.client_version(),
      .pid = open.pid(),
      .held_tensor_ids = {open.held_tensor_ids().begin(), open.held_tensor_ids().end()},
      .unpublished_tensor_ids = {open.unpublished_tensor_ids().begin(),
                                 open.unpublished_tensor_ids().end()},
  };
}

void ToWire(const OpenedSession& opened, v1::SessionOpened* out) {
  out->set_session_id(opened.token);
  out->set_session_number(opened.session_number);
  out->set_server_version(TENSORSHM_VERSION);
  out->set_instance_id(opened.instance_id);
  out->mutable_lease_ids()->Assign(opened.lease_ids.begin(), opened.lease_ids.end());
  for (const bool readopted : opened.readopted) out->add_readopted(readopted);
  for (const auto& [instance, id] : opened.segments) {
    v1::SegmentRef* segment = out->add_segments();
    segment->set_segment_instance(instance);
    segment->set_segment_id(id);
  }
}

Releases FromWire(const v1::ReleaseBatch& batch) {
  return Releases{
      .sequence = batch.sequence(),
      .lease_ids = {batch.lease_ids().begin(), batch.lease_ids().end()},
      .abandoned_tensor_ids = {batch.abandoned_tensor_ids().begin(),
                               batch.abandoned_tensor_ids().end()},
      .settled_request_ids = {batch.settled_request_ids().begin(),
                              batch.settled_request_ids().end()},
  };
}

void ToWire(const ReleasesDone& done, v1::ReleaseAck* out) {
  out->set_sequence(done.sequence);
  for (const ReleasesDone::Refused& refused : done.refused) {
    v1::Rejection* rejection = out->add_rejected();
    rejection->set_id(refused.id);
    rejection->set_code(static_cast<int32_t>(refused.status.code()));
    rejection->set_message(std::string(refused.status.message()));
  }
}

}  // namespace tensorshm
