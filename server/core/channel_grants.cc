#include "server/core/channel_grants.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/memory/cuda_pool.h"

namespace tensorshm {

absl::StatusOr<UniqueFd> ChannelGrants::FastPath(const Session& session,
                                                 const v1::FastPathRequest& request,
                                                 v1::FastPathGrant* grant) {
  if (!offer_fast_path_) {
    return absl::FailedPreconditionError(
        "fast_path: not offered under TENSORSHMD_TEST_CROSS_CANCEL_MS (test mode)");
  }
  absl::StatusOr<UniqueFd> fd = UniqueFd();
  switch (request.part()) {
    case v1::FastPathRequest::INDEX:
      fd = catalog_.index().OpenForClient();
      grant->set_size(catalog_.index().size());
      break;
    case v1::FastPathRequest::RECORDS:
      fd = catalog_.control().OpenForClient();
      grant->set_size(catalog_.control().size());
      break;
    case v1::FastPathRequest::LEASE_PAGE:
      fd = catalog_.OpenLeasePage(session.id, session.uid);
      grant->set_size(kLeasePageBytes);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("fast_path.part = ", static_cast<int>(request.part()),
                       ": expected INDEX (1), RECORDS (2) or LEASE_PAGE (3)"));
  }
  if (!fd.ok()) return fd.status();
  grant->set_part(request.part());
  grant->set_instance_id(catalog_.instance_id());
  return fd;
}

absl::StatusOr<UniqueFd> ChannelGrants::Segment(Session& session, const v1::SegmentRequest& request,
                                                v1::SegmentGrant* grant) {
  if (request.cuda()) return CudaSegment(request, grant);
  const HostPool& pool = catalog_.host_pool();
  const uint64_t id = request.segment_id();
  if (!pool.HasSegment(id)) {
    return absl::NotFoundError(absl::StrCat("segment.segment_id = ", id, ": no such host segment (",
                                            pool.segment_count(), " segments)"));
  }
  if (pool.SegmentInstance(id) != request.segment_instance()) {
    return absl::FailedPreconditionError(
        absl::StrCat("segment.segment_instance = ", request.segment_instance(), ": segment ", id,
                     " is another object now (made by instance ", pool.SegmentInstance(id),
                     "); the daemon restarted since that location was issued"));
  }
  if (request.writable() && pool.SegmentOwner(id) != session.uid) {
    return absl::PermissionDeniedError(
        absl::StrCat("segment.writable: segment ", id, " holds the buffers of uid ",
                     pool.SegmentOwner(id), "; uid ", session.uid, " may only read it"));
  }
  absl::StatusOr<UniqueFd> fd = pool.Segment(id).OpenForClient(request.writable());
  if (!fd.ok()) return fd.status();
  grant->set_segment_id(id);
  grant->set_segment_instance(pool.SegmentInstance(id));
  grant->set_size(pool.SegmentSize(id));
  grant->set_writable(request.writable());
  const ShmSegment& segment = pool.Segment(id);
  grant->set_shm_name(segment.backing() == SegmentBacking::kNamed ? segment.name() : "");
  if (request.writable()) session.writable_segments.emplace(grant->segment_instance(), id);
  return fd;
}

UniqueFd ChannelGrants::AttachNewSegment(Session& session, const v1::Location& location,
                                         v1::ChannelResponse* response) {
  if (!location.has_host() || location.length() == 0 ||
      session.writable_segments.count({location.segment_instance(), location.segment_id()}) > 0) {
    return UniqueFd();
  }
  v1::SegmentRequest want;
  want.set_segment_id(location.segment_id());
  want.set_segment_instance(location.segment_instance());
  want.set_writable(true);
  absl::StatusOr<UniqueFd> fd = Segment(session, want, response->mutable_attached_segment());
  if (!fd.ok()) {
    // The client asks for it as before, and hears why then.
    response->clear_attached_segment();
    return UniqueFd();
  }
  return *std::move(fd);
}

absl::StatusOr<UniqueFd> ChannelGrants::CudaSegment(const v1::SegmentRequest& request,
                                                    v1::SegmentGrant* grant) {
  // Every admitted session may read every published tensor (as host segments are granted
  // read-only to all), so a CUDA segment is granted to any bound session; clients map it
  // read-only. The descriptor itself carries no access mode (see docs/security.md).
  const CudaPool* pool = catalog_.cuda_pool(request.device_ordinal());
  if (pool == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("segment.device_ordinal = ", request.device_ordinal(),
                     ": this tensorshmd has no pool on cuda:", request.device_ordinal()));
  }
  if (request.segment_instance() != catalog_.instance_id()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment.segment_instance = ", request.segment_instance(), ": CUDA segments are instance ",
        catalog_.instance_id(), "'s; the daemon restarted since that location was issued"));
  }
  absl::StatusOr<UniqueFd> fd = pool->SegmentDescriptor(request.segment_id());
  if (!fd.ok()) return fd.status();
  grant->set_segment_id(request.segment_id());
  grant->set_segment_instance(catalog_.instance_id());
  grant->set_size(pool->SegmentSize(request.segment_id()));
  grant->set_granularity(pool->granularity());
  return fd;
}

}  // namespace tensorshm
