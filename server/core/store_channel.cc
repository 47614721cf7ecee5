// The memory channel's requests (see ChannelRequest in the .proto), as the Store carries them
// out: bind, a host segment's or a fast path part's descriptor (ChannelGrants), create, publish
// and delete for the bound session. The channel itself (framing, descriptors, epoll) and its
// messages are server/rpc's.
#include <string>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "server/core/store.h"

namespace tensorshm {

absl::StatusOr<ChannelReplied> Store::Channel(const PeerCredentials& peer,
                                              std::string* session_token, const ChannelAsk& ask) {
  if (policy_ != nullptr) {
    if (absl::Status s = policy_->Admit(peer); !s.ok()) return s;
  }
  // A consumer waiting for the name wakes while the publish is committed, not after it (the
  // index's header needs no lock; see CatalogIndex::WakeWaiters).
  if (std::holds_alternative<PublishOrder>(ask)) index_.WakeWaiters();
  Lock lock(this);
  if (const auto* bind = std::get_if<ChannelBind>(&ask)) {
    if (!session_token->empty()) {
      return absl::FailedPreconditionError("bind: this channel is bound to a session already");
    }
    const tensorshm::Session* session = sessions_.Find(bind->session_token);
    if (session == nullptr) {
      return absl::FailedPreconditionError(
          "bind.session_id: no open session has this id (its stream ended, or it never existed)");
    }
    // Only the process that opened the session may bind to it, as on every gRPC call.
    if (absl::Status s = session->CheckCaller(peer, "bind.session_id"); !s.ok()) return s;
    *session_token = bind->session_token;
    return ChannelReplied{ChannelBound{catalog_->instance_id()}, UniqueFd()};
  }
  if (session_token->empty()) {
    return absl::FailedPreconditionError("kind: bind the channel to a session first");
  }
  tensorshm::Session* session = sessions_.Find(*session_token);
  if (session == nullptr) {
    return absl::FailedPreconditionError(
        "kind: the session this channel is bound to has ended; reconnect");
  }
  if (const auto* segment = std::get_if<SegmentAsk>(&ask)) {
    SegmentGranted grant;
    absl::StatusOr<UniqueFd> fd = grants_.Segment(*session, *segment, &grant);
    if (!fd.ok()) return fd.status();
    return ChannelReplied{std::move(grant), *std::move(fd)};
  }
  if (const auto* part = std::get_if<FastPathAsk>(&ask)) {
    FastPathGranted grant;
    absl::StatusOr<UniqueFd> fd = grants_.FastPath(*session, *part, &grant);
    if (!fd.ok()) return fd.status();
    return ChannelReplied{grant, *std::move(fd)};
  }
  if (const auto* order = std::get_if<CreateOrder>(&ask)) {
    SegmentGrowth growth;
    absl::StatusOr<Created> created = CreateFor(*session, *order, &growth);
    if (created.ok()) {
      ChannelCreated answer{.created = *std::move(created)};
      UniqueFd fd = grants_.AttachNewSegment(*session, answer.created.place, &answer.attached);
      return ChannelReplied{std::move(answer), std::move(fd)};
    }
    if (!growth.needed() && !growth.busy()) return created.status();
    // This thread serves every client's channel: it never makes a segment (posix_fallocate,
    // cuMemAlloc), nor waits for one. UNAVAILABLE sends the client to the gRPC Create, which
    // GrowPools answers once the pool has grown.
    return absl::UnavailableError(
        "create: the pool must grow first; the gRPC Create waits for that");
  }
  if (const auto* order = std::get_if<PublishOrder>(&ask)) {
    absl::StatusOr<Published> published = PublishFor(*session, *order);
    if (!published.ok()) return published.status();
    return ChannelReplied{*std::move(published), UniqueFd()};
  }
  const auto& order = std::get<DeleteOrder>(ask);
  if (absl::Status s = DeleteFor(*session, order.name); !s.ok()) return s;
  return ChannelReplied{Deleted{}, UniqueFd()};
}

}  // namespace tensorshm
