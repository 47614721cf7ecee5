// ChannelDesk: the memory channel's requests, as the Store carries them out: a bind to a session,
// then for the bound session the descriptors it grants (a host or VMM CUDA segment's, the fast
// path's parts: the catalog index, the control segment, the session's lease page), and create,
// publish and delete, a create's answer bringing along the segment its buffer lies in. The
// channel itself (framing, descriptors, epoll) and its messages are server/rpc's.
#ifndef TENSORSHM_SERVER_CORE_CHANNEL_DESK_H_
#define TENSORSHM_SERVER_CORE_CHANNEL_DESK_H_

#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "common/base/unique_fd.h"
#include "server/catalog/catalog.h"
#include "server/core/acquire_waits.h"
#include "server/core/create_queue.h"
#include "server/core/creator.h"
#include "server/core/publisher.h"
#include "server/core/session.h"
#include "server/core/session_desk.h"
#include "server/core/tensor_calls.h"
#include "server/core/waiters.h"

namespace tensorshm {

// The transport's side of the channel requests that may be answered later: each makes the wait
// (the transport's until the Store is done with it: CreateWaiterDone, WaiterDone), its deadline
// set.
struct ChannelWaiters {
  absl::FunctionRef<CreateWait*()> create;
  absl::FunctionRef<AcquireWait*()> acquire;
};

// Thread-compatible: the Store's lock guards it and everything it refers to.
class ChannelDesk {
 public:
  // All outlive it. `offer_fast_path` false: fast path parts are refused (the test hook
  // StoreTestHooks::cross_cancel_hold, under which acquires must take the RPC).
  ChannelDesk(Catalog& catalog, SessionTable& sessions, Creator& creator, CreateQueue& create_queue,
              AcquireWaits& acquire_waits, SessionDesk& session_desk, Publisher& publisher,
              bool offer_fast_path)
      : catalog_(catalog),
        sessions_(sessions),
        creator_(creator),
        create_queue_(create_queue),
        acquire_waits_(acquire_waits),
        session_desk_(session_desk),
        publisher_(publisher),
        offer_fast_path_(offer_fast_path) {}
  ChannelDesk(const ChannelDesk&) = delete;
  ChannelDesk& operator=(const ChannelDesk&) = delete;

  // One request from a connection with `peer`'s credentials (admitted) bound to
  // `*session_token` (empty: none; a bind sets it): the answer with the descriptor it brings, or
  // the refusal. A create that waits (its pool must grow first: this thread serves every
  // client's channel and never makes a segment; or it may wait for memory, CreateOrder.wait_ms)
  // is queued as the CreateWait `waiters.create()` makes, which the grower or CreateQueue
  // answers; an acquire that waits for a publish (AcquireOrder.wait_ms) is listed as the
  // AcquireWait `waiters.acquire()` makes: `*answered_later`, and no answer returned. `stopping`:
  // the Store is shutting down (no new wait).
  absl::StatusOr<ChannelReplied> Carry(const PeerCredentials& peer, std::string* session_token,
                                       const ChannelAsk& ask, const ChannelWaiters& waiters,
                                       bool stopping, bool* answered_later);
  // For a channel create answered later: as its answer would have brought, the writable
  // descriptor of the host segment at `place` if the session `token` names has not been granted
  // it yet, described in `*attached`; none otherwise.
  UniqueFd AttachLater(const std::string& token, const TensorPlace& place,
                       std::optional<SegmentGranted>* attached);

 private:
  // The descriptor of fast path part `ask.part` for `session`, described in `*grant`.
  absl::StatusOr<UniqueFd> FastPath(const Session& session, const FastPathAsk& ask,
                                    FastPathGranted* grant);
  // The descriptor of host segment `ask.segment_id` for `session` (a writable grant is recorded
  // in session.writable_segments), or of a VMM CUDA segment (ask.cuda), described in `*grant`.
  absl::StatusOr<UniqueFd> Segment(Session& session, const SegmentAsk& ask, SegmentGranted* grant);
  // For a channel create's answer: the writable descriptor of the host segment at `place` when
  // `session` has not been granted it yet, described in `*attached`; none otherwise (or when the
  // grant fails: the client then asks, and hears why), and `*attached` is left unset.
  UniqueFd AttachNewSegment(Session& session, const TensorPlace& place,
                            std::optional<SegmentGranted>* attached);
  absl::StatusOr<UniqueFd> CudaSegment(const SegmentAsk& ask, SegmentGranted* grant);

  Catalog& catalog_;
  SessionTable& sessions_;
  Creator& creator_;
  CreateQueue& create_queue_;
  AcquireWaits& acquire_waits_;
  SessionDesk& session_desk_;
  Publisher& publisher_;
  const bool offer_fast_path_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_CHANNEL_DESK_H_
