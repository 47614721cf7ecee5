// The descriptors the memory channel grants a bound session: a host or VMM CUDA segment's, the
// fast path's parts (the catalog index, the control segment, the session's lease page), and the
// segment a channel create's buffer lies in, sent along with its answer. The Store's, under its
// lock: thread-compatible.
#ifndef TENSORSHM_SERVER_CORE_CHANNEL_GRANTS_H_
#define TENSORSHM_SERVER_CORE_CHANNEL_GRANTS_H_

#include <optional>

#include "absl/status/statusor.h"
#include "common/base/unique_fd.h"
#include "server/catalog/catalog.h"
#include "server/core/session.h"
#include "server/core/tensor_calls.h"

namespace tensorshm {

class ChannelGrants {
 public:
  // `catalog` outlives it. `offer_fast_path` false: fast path parts are refused (the test hook
  // StoreTestHooks::cross_cancel_hold, under which acquires must take the RPC).
  ChannelGrants(Catalog& catalog, bool offer_fast_path)
      : catalog_(catalog), offer_fast_path_(offer_fast_path) {}
  ChannelGrants(const ChannelGrants&) = delete;
  ChannelGrants& operator=(const ChannelGrants&) = delete;

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

 private:
  absl::StatusOr<UniqueFd> CudaSegment(const SegmentAsk& ask, SegmentGranted* grant);

  Catalog& catalog_;
  const bool offer_fast_path_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_CHANNEL_GRANTS_H_
