// SessionDesk: the sessions' lives: a Session stream's open (and a reconnecting client's
// reattach), its release batches and settles, its end; and every open session for operators.
#ifndef TENSORSHM_SERVER_CORE_SESSION_DESK_H_
#define TENSORSHM_SERVER_CORE_SESSION_DESK_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/catalog/catalog.h"
#include "server/core/access.h"
#include "server/core/acquire_waits.h"
#include "server/core/create_queue.h"
#include "server/core/leasing.h"
#include "server/core/listings.h"
#include "server/core/session.h"
#include "server/core/session_calls.h"
#include "server/ops/metrics.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {

// Thread-compatible: the Store's lock guards it and everything it refers to.
class SessionDesk {
 public:
  // All outlive it; `policy` may be null (every caller sees everything).
  SessionDesk(Catalog& catalog, SessionTable& sessions, Leasing& leasing,
              AcquireWaits& acquire_waits, CreateQueue& create_queue, UidLimits& uid_limits,
              Metrics& metrics, const AccessPolicy* policy);
  SessionDesk(const SessionDesk&) = delete;
  SessionDesk& operator=(const SessionDesk&) = delete;

  // Opens a session for `peer` (connection `peer_address`), charged to its uid (--uid-*), and
  // takes back what a reconnecting client held. REQUIRES: `open`'s strings are checked
  // (ValidateClientText).
  absl::StatusOr<OpenedSession> Open(const PeerCredentials& peer, const std::string& peer_address,
                                     const SessionOpening& open);
  // A release batch of `session`: its leases and abandoned buffers given back, its settles done;
  // what was refused, and why.
  ReleasesDone Release(Session& session, const Releases& batch);
  // A settle (ReleaseBatch.settled_request_ids) of call `request_id` of `session`: gives back
  // what it granted, ends it CANCELLED if it waits, or remembers the id for when it arrives.
  void Settle(Session& session, uint64_t request_id);

  // What a session held when it ended.
  struct Ended {
    size_t leases = 0;
    size_t unpublished = 0;
    bool kept = false;  // kept for the next daemon (`keep_held`)
  };
  // Ends `session`: answers its waiting acquires and creates, frees what it holds (or, with
  // `keep_held`, leaves it where a crash would for the next daemon's recovery), forgets it.
  Ended Close(Session& session, bool keep_held);

  // Every open session, for `caller`; `own_token` marks the caller's own. PERMISSION_DENIED if
  // `own_token` names a session of another process.
  absl::StatusOr<std::vector<SessionListing>> List(const PeerCredentials& caller,
                                                   const std::string& own_token);

 private:
  // A reconnecting client's leases and unpublished tensors, taken back where the catalog allows;
  // the outcome goes into `opened`.
  void Reattach(Session& session, const SessionOpening& open, OpenedSession* opened);

  Catalog& catalog_;
  SessionTable& sessions_;
  Leasing& leasing_;
  AcquireWaits& acquire_waits_;
  CreateQueue& create_queue_;
  UidLimits& uid_limits_;
  Metrics& metrics_;
  const AccessPolicy* const policy_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_SESSION_DESK_H_
