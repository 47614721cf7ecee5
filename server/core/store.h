// The daemon's state and its rules, with no transport: sessions, create / publish / acquire /
// delete, the waiting acquires and creates, pool growth. Each transport (the gRPC service, the
// memory channel, a test) is a thin adapter that calls these operations in the Store's own terms
// (session_calls.h, tensor_calls.h).
//
// The Store holds the lock and the state; the work is done by its parts, each a class of one
// concern, thread-compatible under the Store's lock (as WaitQueue is): Leasing (leases, what an
// answer says of a tensor, grants kept for settles), AcquireWaits, Creator (a create, its quotas
// and stock), CreateQueue (creates waiting for memory), GrowthQueue (what GrowPools is to grow),
// SessionDesk (sessions), Publisher (names) and ChannelDesk (the memory channel's requests).
#ifndef TENSORSHM_SERVER_CORE_STORE_H_
#define TENSORSHM_SERVER_CORE_STORE_H_

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "common/base/unique_fd.h"
#include "server/catalog/catalog.h"
#include "server/core/access.h"
#include "server/core/acquire_waits.h"
#include "server/core/answers.h"
#include "server/core/channel_desk.h"
#include "server/core/create_queue.h"
#include "server/core/creator.h"
#include "server/core/growth_queue.h"
#include "server/core/leasing.h"
#include "server/core/listings.h"
#include "server/core/publisher.h"
#include "server/core/session.h"
#include "server/core/session_calls.h"
#include "server/core/session_desk.h"
#include "server/core/tensor_calls.h"
#include "server/core/wait_queue.h"
#include "server/core/waiters.h"
#include "server/ops/eviction.h"
#include "server/ops/figures.h"
#include "server/ops/metrics.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {

// What tests make the Store do that production never does; zero: nothing. The daemon fills it
// from the environment (TENSORSHMD_TEST_*, see daemon.cc), and tests that build a Store give it.
struct StoreTestHooks {
  // Non-zero: every answer granting something to a call with a request id is to be sent this much
  // later (the transport does it), and the call's cancellation no longer gives the grant back
  // (WaiterDone, CreateWaiterDone), as when the answer crossed the client's cancel; only the
  // client's settle does. The fast path is not offered either, so that acquires take the RPC.
  absl::Duration cross_cancel_hold = absl::ZeroDuration();
  // Non-zero: every growth of a pool (GrowUnlocked) sleeps this long, with mu_ released, before
  // it makes its segment, as a slow posix_fallocate or cuMemAlloc would.
  absl::Duration growth_delay = absl::ZeroDuration();
};

// Thread-safe: every operation takes the Store's lock (mu_) for its part, and answers what it
// queued (PendingCall::Answer) after releasing it. No operation waits for a pool segment to be
// made, except GrowPools, the only thread that makes segments once the Store serves (also ahead
// of need: see GrowAhead).
//
// A call names its caller by `peer` (the credentials the transport admitted, Admit) and `token`
// (the session it names; nullopt: it named none).
class Store {
 public:
  // `session_quota_bytes`: most bytes of unpublished buffers one session may hold; 0: no limit.
  // `policy` and `peers` (both outliving the Store) decide who may call; null admits all.
  // `uid_limits`: what all sessions of one uid may hold together (--uid-*); {}: no limits.
  // `test_hooks`: {} in production.
  Store(std::unique_ptr<Catalog> catalog, uint64_t session_quota_bytes = 0,
        const AccessPolicy* policy = nullptr, const PeerTable* peers = nullptr,
        const UidLimitsConfig& uid_limits = {}, const StoreTestHooks& test_hooks = {});
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // --evict: what a create that finds its pool full may do first. Call before serving.
  void set_evict_policy(EvictPolicy policy) ABSL_LOCKS_EXCLUDED(mu_) {
    Lock lock(this);
    creator_.set_evict_policy(policy);
  }

  // ---- Admission ----

  // The credentials of the connection `peer_address` (PeerTable's "fd:N") if the policy admits
  // it; PERMISSION_DENIED otherwise. Without a policy: admitted, with empty credentials.
  absl::StatusOr<PeerCredentials> Admit(const std::string& peer_address) const;

  // ---- Sessions (store_sessions.cc) ----

  // A session stream's `open` from `peer` (connection `peer_address`): the new session's
  // SessionOpened, or the refusal; `session_id` and `token` name the new session.
  absl::StatusOr<OpenedSession> OpenSession(const PeerCredentials& peer,
                                            const std::string& peer_address,
                                            const SessionOpening& open) ABSL_LOCKS_EXCLUDED(mu_);
  // A session stream's `release`: the acknowledgement; nullopt if the session is gone.
  std::optional<ReleasesDone> SessionRelease(const std::string& token, const Releases& batch)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the session: drops its leases, frees its unpublished tensors, fails its waiting acquires
  // and creates, forgets it.
  void CloseSession(uint64_t session_id, const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);
  // Every open session, for operators (SessionsRequest); `own_token` marks the caller's own.
  absl::StatusOr<std::vector<SessionListing>> Sessions(const PeerCredentials& caller,
                                                       const std::string& own_token)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Calls of a session (store.cc, store_create.cc, store_acquire.cc) ----

  // A create that does not wait for memory: answered now (returned; OK: the answer is in
  // call->created), or, if a pool must grow first, `call` is queued for GrowPools, which answers
  // it, and `*answered_later` is set (the return value means nothing then).
  absl::Status Create(const PeerCredentials& peer, const std::optional<std::string>& token,
                      CreateCall* call, bool* answered_later) ABSL_LOCKS_EXCLUDED(mu_);
  // A create with wait_ms != 0 (CreateQueue::Wait): answered now (returned; OK: the answer
  // is in waiter->created), or `*answered_later` and `waiter` is answered once it is served,
  // queued for GrowPools or for memory.
  absl::Status CreateWaiting(const PeerCredentials& peer, const std::optional<std::string>& token,
                             CreateWait* waiter, bool* answered_later) ABSL_LOCKS_EXCLUDED(mu_);
  // A waiting create's cancellation: CANCELLED, unless it was answered already.
  void CancelCreate(CreateWait* waiter) ABSL_LOCKS_EXCLUDED(mu_);
  // The transport is done with `waiter` (`cancelled`: its call failed before the client had the
  // answer): a create that succeeded but whose client gave up frees its buffers.
  void CreateWaiterDone(CreateWait* waiter, bool cancelled) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<Published> Publish(const PeerCredentials& peer,
                                    const std::optional<std::string>& token,
                                    const PublishOrder& order) ABSL_LOCKS_EXCLUDED(mu_);
  // Unbinds `name` (its memory goes with its last lease).
  absl::Status Delete(const PeerCredentials& peer, const std::optional<std::string>& token,
                      const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // An Acquire (waiter->deadline set): answered now (returned: a lease in waiter->granted, or a
  // refusal), or listed and `*answered_later`: answered by a publish, its deadline, its
  // cancellation, its session's end or BeginShutdown.
  absl::Status Acquire(const PeerCredentials& peer, const std::optional<std::string>& token,
                       AcquireWait* waiter, bool* answered_later) ABSL_LOCKS_EXCLUDED(mu_);
  // A waiter's cancellation: CANCELLED, unless it was answered already.
  void CancelWaiter(AcquireWait* waiter) ABSL_LOCKS_EXCLUDED(mu_);
  // The transport is done with `waiter` (`cancelled`: its call failed before the client had the
  // answer): drops the lease the answer carried, if any.
  void WaiterDone(AcquireWait* waiter, bool cancelled) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Calls of anyone admitted ----

  // The names bound under `prefix` ("" for all), by name.
  absl::StatusOr<std::vector<TensorListing>> List(const PeerCredentials& caller,
                                                  const std::string& prefix)
      ABSL_LOCKS_EXCLUDED(mu_);
  // What Stat answers, read under mu_ (briefly). Also folds the fast path acquires counted since
  // the last fold into metrics(), so that the figures rendered after it hold every acquire made
  // before the call.
  StoreFigures StatSnapshot() ABSL_LOCKS_EXCLUDED(mu_);

  // One memory channel request from a connection with `peer`'s credentials bound to
  // `*session_token` (empty: none; a bind sets it): binds, grants one segment's descriptor or a
  // fast path part, or creates / publishes / deletes for the bound session. Returns the answer
  // with the descriptor it brings, or the refusal. A create that waits (for its pool to grow, or
  // for memory) or an acquire that waits for a publish is the wait `waiters` makes, answered
  // later: `*answered_later` (see ChannelDesk::Carry). (store_channel.cc)
  absl::StatusOr<ChannelReplied> Channel(const PeerCredentials& peer, std::string* session_token,
                                         const ChannelAsk& ask, const ChannelWaiters& waiters,
                                         bool* answered_later) ABSL_LOCKS_EXCLUDED(mu_);
  // For a channel create answered later, what its answer brings along: the writable descriptor of
  // the segment at `place` if the session `token` names has not been granted it yet, described in
  // `*attached`.
  UniqueFd AttachLater(const std::string& token, const TensorPlace& place,
                       std::optional<SegmentGranted>* attached) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- The daemon's life ----

  // --keep-segments, called as the stop begins: the shm objects outlive this daemon, so from now
  // on a session that ends keeps what it holds where a crash would leave it (its leases, on
  // unbound tensors too, and its unpublished buffers stay in the control segment) for its client
  // to take back in the next daemon's recovery grace.
  void KeepHeldOnStop() ABSL_LOCKS_EXCLUDED(mu_);
  // Answers acquire waiters and waiting creates (and makes new waits fail) with UNAVAILABLE, and
  // ends ExpireWaiters, GrowPools and Housekeep; call before stopping the transports so that no
  // call outlives them.
  void BeginShutdown() ABSL_LOCKS_EXCLUDED(mu_);
  // Answers acquire waiters whose deadline passed with DEADLINE_EXCEEDED, and waiting creates
  // whose deadline passed with RESOURCE_EXHAUSTED, each when its time comes, until BeginShutdown.
  // Runs on a thread of its own.
  void ExpireWaiters() ABSL_LOCKS_EXCLUDED(mu_);
  // Answers the creates that need a pool to grow, one at a time, until BeginShutdown (then those
  // still queued get UNAVAILABLE): making a segment takes long, and no transport thread may wait
  // for it. When no create waits for it, grows the host pool ahead of need for the uids
  // GrowAhead named. Runs on a thread of its own. (store_growth.cc)
  void GrowPools() ABSL_LOCKS_EXCLUDED(mu_);
  // After a restart's grace period: frees unbound tensors nobody came back for.
  int ExpireUnbound() ABSL_LOCKS_EXCLUDED(mu_);
  // Runs the fast path's housekeeping until BeginShutdown: every kHeartbeatIntervalNs, stores
  // the heartbeat in the index and frees retired tensors whose lease page slots were cleared.
  void Housekeep() ABSL_LOCKS_EXCLUDED(mu_);
  // --keep-segments: leave the shm objects for the next daemon with this prefix.
  void KeepSegments() ABSL_LOCKS_EXCLUDED(mu_);

  // The counters and histogram of --metrics (thread-safe on their own).
  const Metrics& metrics() const { return metrics_; }
  Metrics& metrics() { return metrics_; }

 private:
  // Holds mu_ for its scope; on release, answers the calls queued in answers_ meanwhile, after
  // unlocking.
  class ABSL_SCOPED_LOCKABLE Lock {
   public:
    explicit Lock(Store* store) ABSL_EXCLUSIVE_LOCK_FUNCTION(store->mu_) : store_(store) {
      store_->mu_.lock();
    }
    ~Lock() ABSL_UNLOCK_FUNCTION() { store_->UnlockAndFinish(); }
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;

   private:
    Store* store_;
  };
  // Releases mu_, then answers what was queued in answers_.
  void UnlockAndFinish() ABSL_UNLOCK_FUNCTION(mu_);

  // The session named by `token` (nullopt: the call named none), for `caller` (what Admit
  // returned for the call). INVALID_ARGUMENT if it named none, FAILED_PRECONDITION if no open
  // session has that token (NoSessionError), PERMISSION_DENIED if `caller` is not the process
  // that opened it (Session::CheckCaller).
  absl::StatusOr<tensorshm::Session*> CallerSession(const std::optional<std::string>& token,
                                                    const PeerCredentials& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // StatSnapshot's work, under mu_.
  StoreFigures StatLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds the fast path acquires the lease pages counted since the last call to metrics_ (as
  // acquires answered OK). Called by every housekeeping round and every StatSnapshot.
  void FoldFastAcquires() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Pool growth, GrowPools' (store_growth.cc) ----

  // Creator::Create for the session with `token` that grows a pool when it must: the segment is
  // made with mu_ released, then the create is tried again, the session looked up again (it may
  // have ended meanwhile: `gone` is returned then). Blocks while another caller grows the pool,
  // and while it grows one: for GrowPools only. `pool_full`, if set, as Creator::Create's.
  absl::StatusOr<Created> CreateGrowing(const std::string& token, const absl::Status& gone,
                                        const CreateOrder& order, bool* pool_full = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // GrowPools' growth ahead for `uid`, if the pool still plans it: makes the segment with mu_
  // released (no create waits for it, so a failure is logged, not answered).
  void GrowAheadNow(uint32_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the segment `growth` asks for with mu_ released meanwhile (BeginGrowth, Make,
  // EndGrowth), then wakes the calls waiting for a growth. Returns EndGrowth's status; mu_ is
  // held again on return. REQUIRES: growth.needed().
  absl::Status GrowUnlocked(SegmentGrowth& growth) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives back the empty segments of uids that have gone (HostPool::GiveBackIdle) and empties
  // them with mu_ released (as GrowUnlocked): for GrowPools only.
  void GiveBackIdleSegments() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The catalog's index, for the heartbeat, which needs no lock (header atomics only).
  CatalogIndex& index_;
  Mutex mu_;
  CondVar stopping_;       // signalled on shutdown (wakes Housekeep)
  CondVar grown_;          // signalled when a pool's growth ends
  CondVar next_deadline_;  // signalled when the earliest waiter deadline moves closer, or shutdown
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool keep_held_on_stop_ ABSL_GUARDED_BY(mu_) = false;    // KeepHeldOnStop
  bool warned_growth_ahead_ ABSL_GUARDED_BY(mu_) = false;  // a failed growth ahead was logged
  // Calls to answer once mu_ is released (Lock).
  Answers answers_ ABSL_GUARDED_BY(mu_);
  const absl::Duration cross_cancel_hold_;  // StoreTestHooks::cross_cancel_hold
  const absl::Duration growth_delay_;       // StoreTestHooks::growth_delay
  std::unique_ptr<Catalog> catalog_ ABSL_GUARDED_BY(mu_);
  // catalog_->FastAcquires() at the last FoldFastAcquires: what metrics_ holds of them.
  uint64_t fast_acquires_counted_ ABSL_GUARDED_BY(mu_) = 0;
  const AccessPolicy* const policy_;
  const PeerTable* const peers_;
  // Thread-safe on its own; declared before sessions_, whose charges it must outlive.
  UidLimits uid_limits_;
  SessionTable sessions_ ABSL_GUARDED_BY(mu_);
  Metrics metrics_;  // thread-safe on its own
  // The Store's parts, each thread-compatible under mu_ (they refer to the members above and to
  // each other; declared in the order they are built).
  Leasing leasing_ ABSL_GUARDED_BY(mu_);
  AcquireWaits acquire_waits_ ABSL_GUARDED_BY(mu_);
  GrowthQueue growth_ ABSL_GUARDED_BY(mu_);
  Creator creator_ ABSL_GUARDED_BY(mu_);  // queues behind create_queue_ (built after it)
  CreateQueue create_queue_ ABSL_GUARDED_BY(mu_);
  SessionDesk session_desk_ ABSL_GUARDED_BY(mu_);
  Publisher publisher_ ABSL_GUARDED_BY(mu_);
  ChannelDesk channel_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_STORE_H_
