#include "server/core/channel_grants.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/memory/cuda_pool.h"

namespace tensorshm {

absl::StatusOr<UniqueFd> ChannelGrants::FastPath(const Session& session, const FastPathAsk& ask,
                                                 FastPathGranted* grant) {
  if (!offer_fast_path_) {
    return absl::FailedPreconditionError(
        "fast_path: not offered under TENSORSHMD_TEST_CROSS_CANCEL_MS (test mode)");
  }
  absl::StatusOr<UniqueFd> fd = UniqueFd();
  const auto part = static_cast<FastPathPart>(ask.part);
  switch (part) {
    case FastPathPart::kIndex:
      fd = catalog_.index().OpenForClient();
      grant->size = catalog_.index().size();
      break;
    case FastPathPart::kRecords:
      fd = catalog_.control().OpenForClient();
      grant->size = catalog_.control().size();
      break;
    case FastPathPart::kLeasePage:
      fd = catalog_.OpenLeasePage(session.id, session.uid);
      grant->size = kLeasePageBytes;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "fast_path.part = ", ask.part, ": expected INDEX (1), RECORDS (2) or LEASE_PAGE (3)"));
  }
  if (!fd.ok()) return fd.status();
  grant->part = part;
  grant->instance_id = catalog_.instance_id();
  return fd;
}

absl::StatusOr<UniqueFd> ChannelGrants::Segment(Session& session, const SegmentAsk& ask,
                                                SegmentGranted* grant) {
  if (ask.cuda) return CudaSegment(ask, grant);
  const HostPool& pool = catalog_.host_pool();
  const uint64_t id = ask.segment_id;
  if (!pool.HasSegment(id)) {
    return absl::NotFoundError(absl::StrCat("segment.segment_id = ", id, ": no such host segment (",
                                            pool.segment_count(), " segments)"));
  }
  if (pool.SegmentInstance(id) != ask.segment_instance) {
    return absl::FailedPreconditionError(
        absl::StrCat("segment.segment_instance = ", ask.segment_instance, ": segment ", id,
                     " is another object now (made by instance ", pool.SegmentInstance(id),
                     "); the daemon restarted since that location was issued"));
  }
  if (ask.writable && pool.SegmentOwner(id) != session.uid) {
    return absl::PermissionDeniedError(
        absl::StrCat("segment.writable: segment ", id, " holds the buffers of uid ",
                     pool.SegmentOwner(id), "; uid ", session.uid, " may only read it"));
  }
  absl::StatusOr<UniqueFd> fd = pool.Segment(id).OpenForClient(ask.writable);
  if (!fd.ok()) return fd.status();
  const ShmSegment& segment = pool.Segment(id);
  *grant =
      SegmentGranted{.segment_id = id,
                     .segment_instance = pool.SegmentInstance(id),
                     .size = pool.SegmentSize(id),
                     .writable = ask.writable,
                     .shm_name = segment.backing() == SegmentBacking::kNamed ? segment.name() : ""};
  if (ask.writable) session.writable_segments.emplace(grant->segment_instance, id);
  return fd;
}

UniqueFd ChannelGrants::AttachNewSegment(Session& session, const TensorPlace& place,
                                         std::optional<SegmentGranted>* attached) {
  if (!place.shm_name.has_value() || place.length == 0 ||
      session.writable_segments.count({place.segment_instance, place.segment_id}) > 0) {
    return UniqueFd();
  }
  const SegmentAsk want{
      .segment_id = place.segment_id, .segment_instance = place.segment_instance, .writable = true};
  SegmentGranted grant;
  absl::StatusOr<UniqueFd> fd = Segment(session, want, &grant);
  // Refused: the client asks for it as before, and hears why then.
  if (!fd.ok()) return UniqueFd();
  *attached = std::move(grant);
  return *std::move(fd);
}

absl::StatusOr<UniqueFd> ChannelGrants::CudaSegment(const SegmentAsk& ask, SegmentGranted* grant) {
  // Every admitted session may read every published tensor (as host segments are granted
  // read-only to all), so a CUDA segment is granted to any bound session; clients map it
  // read-only. The descriptor itself carries no access mode (see docs/security.md).
  const CudaPool* pool = catalog_.cuda_pool(ask.device_ordinal);
  if (pool == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("segment.device_ordinal = ", ask.device_ordinal,
                     ": this tensorshmd has no pool on cuda:", ask.device_ordinal));
  }
  if (ask.segment_instance != catalog_.instance_id()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment.segment_instance = ", ask.segment_instance, ": CUDA segments are instance ",
        catalog_.instance_id(), "'s; the daemon restarted since that location was issued"));
  }
  absl::StatusOr<UniqueFd> fd = pool->SegmentDescriptor(ask.segment_id);
  if (!fd.ok()) return fd.status();
  *grant = SegmentGranted{.segment_id = ask.segment_id,
                          .segment_instance = catalog_.instance_id(),
                          .size = pool->SegmentSize(ask.segment_id),
                          .granularity = pool->granularity()};
  return fd;
}

}  // namespace tensorshm
