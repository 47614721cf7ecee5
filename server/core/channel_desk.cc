#include "server/core/channel_desk.h"

#include <string>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "common/tensor/name.h"
#include "server/memory/cuda_pool.h"

namespace tensorshm {

absl::StatusOr<ChannelReplied> ChannelDesk::Carry(const PeerCredentials& peer,
                                                  std::string* session_token, const ChannelAsk& ask,
                                                  const ChannelWaiters& waiters, bool stopping,
                                                  bool* answered_later) {
  if (const auto* bind = std::get_if<ChannelBind>(&ask)) {
    if (!session_token->empty()) {
      return absl::FailedPreconditionError("bind: this channel is bound to a session already");
    }
    const Session* session = sessions_.Find(bind->session_token);
    if (session == nullptr) {
      return absl::FailedPreconditionError(
          "bind.session_id: no open session has this id (its stream ended, or it never existed)");
    }
    // Only the process that opened the session may bind to it, as on every gRPC call.
    if (absl::Status s = session->CheckCaller(peer, "bind.session_id"); !s.ok()) return s;
    *session_token = bind->session_token;
    return ChannelReplied{ChannelBound{catalog_.instance_id()}, UniqueFd()};
  }
  if (session_token->empty()) {
    return absl::FailedPreconditionError("kind: bind the channel to a session first");
  }
  Session* session = sessions_.Find(*session_token);
  if (session == nullptr) {
    return absl::FailedPreconditionError(
        "kind: the session this channel is bound to has ended; reconnect");
  }
  if (const auto* segment = std::get_if<SegmentAsk>(&ask)) {
    SegmentGranted grant;
    absl::StatusOr<UniqueFd> fd = Segment(*session, *segment, &grant);
    if (!fd.ok()) return fd.status();
    return ChannelReplied{std::move(grant), *std::move(fd)};
  }
  if (const auto* part = std::get_if<FastPathAsk>(&ask)) {
    FastPathGranted grant;
    absl::StatusOr<UniqueFd> fd = FastPath(*session, *part, &grant);
    if (!fd.ok()) return fd.status();
    return ChannelReplied{grant, *std::move(fd)};
  }
  if (const auto* order = std::get_if<CreateOrder>(&ask)) {
    ChannelCreated answer;
    bool made = false;
    if (order->wait_ms == 0) {
      SegmentGrowth growth;
      absl::StatusOr<Created> created = creator_.Create(*session, *order, &growth);
      if (!created.ok() && !growth.needed() && !growth.busy()) return created.status();
      made = created.ok();
      if (made) answer.created = *std::move(created);
    }
    if (!made) {
      // This thread serves every client's channel: it never makes a segment (posix_fallocate,
      // cuMemAlloc), nor waits for memory. The grower or the create queue answers.
      CreateWait* waiting = waiters.create();
      if (absl::Status s = create_queue_.Wait(*session, waiting, stopping, answered_later);
          !s.ok()) {
        return s;
      }
      if (*answered_later) return ChannelReplied{};
      answer.created = waiting->created;  // found room at once
    }
    UniqueFd fd = AttachNewSegment(*session, answer.created.place, &answer.attached);
    return ChannelReplied{std::move(answer), std::move(fd)};
  }
  if (const auto* batch = std::get_if<Releases>(&ask)) {
    return ChannelReplied{session_desk_.Release(*session, *batch), UniqueFd()};
  }
  if (const auto* order = std::get_if<AcquireOrder>(&ask)) {
    if (absl::Status s = ValidateName(order->name); !s.ok()) return s;
    AcquireWait* waiting = waiters.acquire();
    if (absl::Status s = acquire_waits_.Acquire(*session, waiting, stopping, answered_later);
        !s.ok()) {
      return s;
    }
    if (*answered_later) return ChannelReplied{};
    return ChannelReplied{waiting->granted, UniqueFd()};
  }
  if (const auto* order = std::get_if<PublishOrder>(&ask)) {
    absl::StatusOr<Published> published = publisher_.Publish(*session, *order);
    if (!published.ok()) return published.status();
    return ChannelReplied{*std::move(published), UniqueFd()};
  }
  const auto& order = std::get<DeleteOrder>(ask);
  if (absl::Status s = publisher_.Delete(*session, order.name); !s.ok()) return s;
  return ChannelReplied{Deleted{}, UniqueFd()};
}

UniqueFd ChannelDesk::AttachLater(const std::string& token, const TensorPlace& place,
                                  std::optional<SegmentGranted>* attached) {
  Session* session = sessions_.Find(token);
  if (session == nullptr) return UniqueFd();
  return AttachNewSegment(*session, place, attached);
}

absl::StatusOr<UniqueFd> ChannelDesk::FastPath(const Session& session, const FastPathAsk& ask,
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

absl::StatusOr<UniqueFd> ChannelDesk::Segment(Session& session, const SegmentAsk& ask,
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

UniqueFd ChannelDesk::AttachNewSegment(Session& session, const TensorPlace& place,
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

absl::StatusOr<UniqueFd> ChannelDesk::CudaSegment(const SegmentAsk& ask, SegmentGranted* grant) {
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
