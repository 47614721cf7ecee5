// The memory channel's requests (see ChannelRequest in the .proto), as the Store carries them
// out: bind, a host segment's or a fast path part's descriptor (ChannelGrants), create, publish
// and delete for the bound session. The channel itself (framing, descriptors, epoll) is
// server/rpc's.
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
        fd = grants_.Segment(*session, request.segment(), response->mutable_segment());
        break;
      case v1::ChannelRequest::kFastPath:
        fd = grants_.FastPath(*session, request.fast_path(), response->mutable_fast_path());
        break;
      case v1::ChannelRequest::kCreate: {
        SegmentGrowth growth;
        absl::Status created =
            CreateFor(*session, request.create(), response->mutable_created(), &growth);
        if (created.ok()) {
          fd = grants_.AttachNewSegment(*session, response->created().location(), response);
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
        return DeleteFor(*session, request.delete_().name());
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

}  // namespace tensorshm
