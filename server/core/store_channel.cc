// The memory channel's requests (see ChannelRequest in the .proto), as the Store carries them
// out: bind, a host segment's or a fast path part's descriptor, create, publish and delete for the
// bound session. The channel itself (framing, descriptors, epoll) is server/rpc's.
#include <string>

#include "absl/strings/str_cat.h"
#include "server/core/store.h"

namespace tensorshm {

absl::StatusOr<UniqueFd> Store::Channel(const PeerCredentials& peer, std::string* session_token,
                                        const v1::ChannelRequest& request,
                                        v1::ChannelResponse* response) {
  UniqueFd granted_fd;
  absl::Status status = [&]() -> absl::Status {
    if (policy_ != nullptr) {
      if (absl::Status s = policy_->Admit(peer); !s.ok()) return s;
    }
    // A consumer waiting for the name wakes while the publish is committed, not after it (the
    // index's header needs no lock; see CatalogIndex::WakeWaiters).
    if (request.has_publish()) index_.WakeWaiters();
    Lock lock(this);
    if (request.has_bind()) {
      if (!session_token->empty()) {
        return absl::FailedPreconditionError("bind: this channel is bound to a session already");
      }
      const tensorshm::Session* session = sessions_.Find(request.bind().session_id());
      if (session == nullptr) {
        return absl::FailedPreconditionError(
            "bind.session_id: no open session has this id (its stream ended, or it never "
            "existed)");
      }
      // Only the process that opened the session may bind to it, as on every gRPC call.
      if (absl::Status s = session->CheckCaller(peer, "bind.session_id"); !s.ok()) return s;
      *session_token = request.bind().session_id();
      response->mutable_bound()->set_instance_id(catalog_->instance_id());
      return absl::OkStatus();
    }
    if (request.kind_case() == v1::ChannelRequest::KIND_NOT_SET) {
      return absl::InvalidArgumentError(
          "kind: not set (bind, segment, fast_path, create or publish)");
    }
    if (session_token->empty()) {
      return absl::FailedPreconditionError("kind: bind the channel to a session first");
    }
    tensorshm::Session* session = sessions_.Find(*session_token);
    if (session == nullptr) {
      return absl::FailedPreconditionError(
          "kind: the session this channel is bound to has ended; reconnect");
    }
    absl::StatusOr<UniqueFd> fd = UniqueFd();
    switch (request.kind_case()) {
      case v1::ChannelRequest::kSegment:
        fd = GrantSegment(*session, request.segment(), response->mutable_segment());
        break;
      case v1::ChannelRequest::kFastPath:
        fd = GrantFastPath(*session, request.fast_path(), response->mutable_fast_path());
        break;
      case v1::ChannelRequest::kCreate: {
        SegmentGrowth growth;
        absl::Status created =
            CreateFor(*session, request.create(), response->mutable_created(), &growth);
        if (created.ok()) {
          fd = AttachNewSegment(*session, response->created().location(), response);
          break;
        }
        if (!growth.needed() && !growth.busy()) return created;
        // This thread serves every client's channel: it never makes a segment (posix_fallocate,
        // cuMemAlloc), nor waits for one. UNAVAILABLE sends the client to the gRPC Create, which
        // GrowPools answers once the pool has grown.
        return absl::UnavailableError(
            "create: the pool must grow first; the gRPC Create waits for that");
      }
      case v1::ChannelRequest::kPublish:
        return PublishFor(*session, request.publish(), response->mutable_published());
      case v1::ChannelRequest::kDelete:
        response->mutable_deleted();
        return DeleteFor(*session, request.delete_());
      default:
        return absl::InvalidArgumentError("kind: not a request this daemon knows");
    }
    if (!fd.ok()) return fd.status();
    granted_fd = *std::move(fd);
    return absl::OkStatus();
  }();
  if (!status.ok()) return status;
  return granted_fd;
}

absl::StatusOr<UniqueFd> Store::GrantFastPath(const tensorshm::Session& session,
                                              const v1::FastPathRequest& request,
                                              v1::FastPathGrant* grant) {
  if (cross_cancel_hold_ > absl::ZeroDuration()) {
    return absl::FailedPreconditionError(
        "fast_path: not offered under TENSORSHMD_TEST_CROSS_CANCEL_MS (test mode)");
  }
  absl::StatusOr<UniqueFd> fd = UniqueFd();
  switch (request.part()) {
    case v1::FastPathRequest::INDEX:
      fd = catalog_->index().OpenForClient();
      grant->set_size(catalog_->index().size());
      break;
    case v1::FastPathRequest::RECORDS:
      fd = catalog_->control().OpenForClient();
      grant->set_size(catalog_->control().size());
      break;
    case v1::FastPathRequest::LEASE_PAGE:
      fd = catalog_->OpenLeasePage(session.id, session.uid);
      grant->set_size(kLeasePageBytes);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("fast_path.part = ", static_cast<int>(request.part()),
                       ": expected INDEX (1), RECORDS (2) or LEASE_PAGE (3)"));
  }
  if (!fd.ok()) return fd.status();
  grant->set_part(request.part());
  grant->set_instance_id(catalog_->instance_id());
  return fd;
}

absl::StatusOr<UniqueFd> Store::GrantSegment(tensorshm::Session& session,
                                             const v1::SegmentRequest& request,
                                             v1::SegmentGrant* grant) {
  if (request.cuda()) return GrantCudaSegment(request, grant);
  const HostPool& pool = catalog_->host_pool();
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

UniqueFd Store::AttachNewSegment(tensorshm::Session& session, const v1::Location& location,
                                 v1::ChannelResponse* response) {
  if (!location.has_host() || location.length() == 0 ||
      session.writable_segments.count({location.segment_instance(), location.segment_id()}) > 0) {
    return UniqueFd();
  }
  v1::SegmentRequest want;
  want.set_segment_id(location.segment_id());
  want.set_segment_instance(location.segment_instance());
  want.set_writable(true);
  absl::StatusOr<UniqueFd> fd = GrantSegment(session, want, response->mutable_attached_segment());
  if (!fd.ok()) {
    // The client asks for it as before, and hears why then.
    response->clear_attached_segment();
    return UniqueFd();
  }
  return *std::move(fd);
}

absl::StatusOr<UniqueFd> Store::GrantCudaSegment(const v1::SegmentRequest& request,
                                                 v1::SegmentGrant* grant) {
  // Every admitted session may read every published tensor (as host segments are granted
  // read-only to all), so a CUDA segment is granted to any bound session; clients map it
  // read-only. The descriptor itself carries no access mode (see docs/security.md).
  const CudaPool* pool = catalog_->cuda_pool(request.device_ordinal());
  if (pool == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("segment.device_ordinal = ", request.device_ordinal(),
                     ": this tensorshmd has no pool on cuda:", request.device_ordinal()));
  }
  if (request.segment_instance() != catalog_->instance_id()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment.segment_instance = ", request.segment_instance(), ": CUDA segments are instance ",
        catalog_->instance_id(), "'s; the daemon restarted since that location was issued"));
  }
  absl::StatusOr<UniqueFd> fd = pool->SegmentDescriptor(request.segment_id());
  if (!fd.ok()) return fd.status();
  grant->set_segment_id(request.segment_id());
  grant->set_segment_instance(catalog_->instance_id());
  grant->set_size(pool->SegmentSize(request.segment_id()));
  grant->set_granularity(pool->granularity());
  return fd;
}

}  // namespace tensorshm
