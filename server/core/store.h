// The daemon's state and its rules, with no transport: sessions, create / publish / acquire /
// delete, the waiting acquires and creates, pool growth. Each transport (the gRPC service, the
// memory channel, a test) is a thin adapter that calls these operations with plain arguments.
#ifndef TENSORSHM_SERVER_CORE_STORE_H_
#define TENSORSHM_SERVER_CORE_STORE_H_

#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "common/base/unique_fd.h"
#include "server/catalog/catalog.h"
#include "server/core/access.h"
#include "server/core/channel_grants.h"
#include "server/core/listings.h"
#include "server/core/session.h"
#include "server/core/session_calls.h"
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
  void set_evict_policy(EvictPolicy policy) { evict_ = policy; }

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
  // A create with wait_ms != 0 (store_create_waiters.cc): answered now (returned; OK: the answer
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
  // with the descriptor it brings, or the refusal. (store_channel.cc)
  absl::StatusOr<ChannelReplied> Channel(const PeerCredentials& peer, std::string* session_token,
                                         const ChannelAsk& ask) ABSL_LOCKS_EXCLUDED(mu_);

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

  // StoreTestHooks::cross_cancel_hold: zero in production.
  absl::Duration cross_cancel_hold() const { return cross_cancel_hold_; }

 private:
  // Holds mu_ for its scope; on release, answers the calls queued in finishing_ meanwhile, after
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
  // Releases mu_, then answers what was queued in finishing_.
  void UnlockAndFinish() ABSL_UNLOCK_FUNCTION(mu_);

  // The session named by `token` (nullopt: the call named none), for `caller` (what Admit
  // returned for the call). INVALID_ARGUMENT if it named none, FAILED_PRECONDITION if no open
  // session has that token (NoSession), PERMISSION_DENIED if `caller` is not the process that
  // opened it (Session::CheckCaller).
  absl::StatusOr<tensorshm::Session*> CallerSession(const std::optional<std::string>& token,
                                                    const PeerCredentials& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static absl::Status NoSession(const std::string& token);
  // StatSnapshot's work, under mu_.
  StoreFigures StatLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Queues `call` to be answered with `status` once mu_ is released.
  void AnswerLater(PendingCall* call, absl::Status status, bool granted = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues `waiter`, already off every list, to be answered with `status` once mu_ is released,
  // and counts its answer (metrics_).
  void FinishLater(AcquireWait* waiter, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Waiting acquires (store_acquire.cc). AddWaiter puts a waiter of `session` on its name's list,
  // its session's list and (with a finite deadline) the deadline queue; RemoveWaiter takes it off
  // all three. AddWaiter is where a limit on waiting acquires (per uid) is checked: an error
  // refuses the wait and the waiter is not added.
  absl::Status AddWaiter(AcquireWait* waiter, const tensorshm::Session& session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveWaiter(AcquireWait* waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives every waiter for `name` (just published) a lease on it and queues it to finish.
  void WakeWaiters(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails every waiter of the session `session_id` (ending) as a call naming `token` would be.
  void FailSessionWaiters(uint64_t session_id, const std::string& token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new lease of `session` on `tensor`, as an Acquire answers it.
  LeaseGrant Grant(tensorshm::Session& session, const Tensor& tensor)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // CreateFor for the session with `token` that grows a pool when it must: the segment is made
  // with mu_ released, then the create is tried again, the session looked up again (it may have
  // ended meanwhile: `gone` is returned then). Blocks while another caller grows the pool, and
  // while it grows one: for GrowPools only.
  // `pool_full`, if set, as CreateFor's.
  absl::StatusOr<Created> CreateGrowing(const std::string& token, const absl::Status& gone,
                                        const CreateOrder& order, bool* pool_full = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Adds the fast path acquires the lease pages counted since the last call to metrics_ (as
  // acquires answered OK). Called by every housekeeping round and every StatSnapshot.
  void FoldFastAcquires() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // OK if `session` may delete or replace `tensor`: its publisher's uid, or the daemon's.
  absl::Status MayChange(const tensorshm::Session& session, const Tensor& tensor,
                         absl::string_view verb) const;
  // Whether `caller` sees every detail of what uid `uid`'s processes do (their pids, client
  // names): true for that uid itself, the daemon's uid and root, and without a policy. See
  // SessionsRequest in the .proto for why others see less.
  bool SeesDetailsOf(const PeerCredentials& caller, uint32_t uid) const;
  // A reconnecting client's SessionOpen: leases and unpublished tensors it held before the
  // daemon restarted, taken back where the catalog allows; the outcome goes into `opened`.
  void Reattach(tensorshm::Session& session, const SessionOpening& open, OpenedSession* opened)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ReleasesDone HandleReleases(tensorshm::Session& session, const Releases& batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A settle (ReleaseBatch.settled_request_ids) of call `request_id` of `session`: gives back
  // what it granted, ends it CANCELLED if it waits, or remembers the id for when it arrives.
  void SettleRequest(tensorshm::Session& session, uint64_t request_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives back what `grant` holds that `session` still holds: the lease, unpublished tensors.
  void GiveBack(tensorshm::Session& session, const tensorshm::Session::RequestGrant& grant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A settle of a create of session `session_id` waiting for memory: finishes it CANCELLED (and
  // returns true), if there is one with `request_id`.
  bool CancelSettledCreate(uint64_t session_id, uint64_t request_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a create of call `request_id` by the session with `token` made `created`:
  // kept for a settle (OK), or given back at once if the client settled the call already
  // (CANCELLED), or the session's `gone` if it ended.
  absl::Status KeepCreated(const std::string& token, const absl::Status& gone, uint64_t request_id,
                           const Created& created) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a new lease of `session` on `tensor` (sealed) and returns its id.
  // REQUIRES: the lease is charged to session.uid_charge already.
  uint64_t AddLease(tensorshm::Session& session, const Tensor& tensor)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The daemon's ordinal of the CUDA device with `uuid`. INVALID_ARGUMENT unless `device` is
  // CUDA and `uuid` 16 bytes, FAILED_PRECONDITION if no pool is on that device.
  absl::StatusOr<int> CudaOrdinalOf(const DLDevice& device, const std::string& uuid) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A tensor's layout as clients read it.
  static DecodedTensor DescriptionOf(const Tensor& tensor);
  // Where a tensor's bytes lie, as clients map them.
  TensorPlace PlaceOf(const Tensor& tensor) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Create and Publish for `session`, whichever transport asked. A create that needs a new pool
  // segment returns UNAVAILABLE with `growth` saying so (see SegmentGrowth): CreateGrowing.
  // With --evict lru a full pool evicts first (Catalog::CreateEvicting). A create that finds its
  // pool (or the record table) full, or creates waiting for that memory ahead of it (unless
  // `waited`: it is one of them), returns RESOURCE_EXHAUSTED and sets `*pool_full` (if given):
  // it may wait. Quota refusals do not set it.
  absl::StatusOr<Created> CreateFor(tensorshm::Session& session, const CreateOrder& order,
                                    SegmentGrowth* growth, bool waited = false,
                                    bool* pool_full = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED naming the limit and its flag if a buffer for a tensor of `dtype`,
  // `shape`, `strides` on `device` would take `session` past --session-quota or its uid past
  // --uid-quota; OK otherwise, and when the layout is invalid (Catalog::Create says why). Takes
  // and counts nothing: CreateFor asks before it allocates.
  absl::Status CheckCreateQuotas(tensorshm::Session& session, const DLDataType& dtype,
                                 absl::Span<const int64_t> shape, absl::Span<const int64_t> strides,
                                 const DLDevice& device, bool subbyte_padded)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Published> PublishFor(tensorshm::Session& session, const PublishOrder& order)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After an allocation in `uid`'s host segments: if the host pool plans growth ahead of need for
  // it (HostPool::PlanAhead), names it for GrowPools, which makes the segment in the background.
  void GrowAhead(uint32_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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

  // Makes up to `count` unpublished uint8 buffers of `length` bytes for `session` ahead of its
  // need (CreateOrder.stock), fewer when the pool is short; none under a session quota. Stock
  // never grows a pool: it takes what the segments made so far hold.
  std::vector<Stocked> Stock(tensorshm::Session& session, uint64_t length, uint32_t count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status DeleteFor(const tensorshm::Session& session, const std::string& name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Creates that wait for memory (store_create_waiters.cc) ----

  // Queues `waiter` of `session` (whose create found its pool full with `refusal`), charged to
  // its uid's --uid-waiters; an error refuses the wait and queues nothing.
  absl::Status AddCreateWaiter(CreateWait* waiter, const tensorshm::Session& session,
                               const absl::Status& refusal) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveCreateWaiter(CreateWait* waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tries the waiting creates again, in order; once one for a PoolKey still does not fit, the
  // later ones for that key wait on (first come, first served). Finishes those that are done.
  void RetryWaitingCreates() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finishes the waiting creates whose deadline is not after `now`; true if there were any.
  bool ExpireCreates(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finishes the waiting creates of session `session_id` (ending), or all of them, with `status`.
  void FailSessionCreates(uint64_t session_id, const std::string& token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailWaitingCreates(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues `waiter`, off the queue, to be finished with `status` once mu_ is released, and counts
  // its answer (metrics_).
  void FinishCreate(CreateWait* waiter, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // GrowPools' answer `status` to `waiter`: finished, or queued if its pool was full.
  void FinishGrownCreate(CreateWait* waiter, const absl::Status& status, bool pool_full)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED if creates wait for the memory of `key` (a new create queues behind
  // them); OK otherwise.
  absl::Status CheckCreateQueue(const PoolKey& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "cpu pool: U of C bytes used" for `key`'s pool.
  std::string PoolUsage(const PoolKey& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The catalog's index, for the heartbeat, which needs no lock (header atomics only).
  CatalogIndex& index_;
  Mutex mu_;
  CondVar stopping_;       // signalled on shutdown (wakes Housekeep)
  CondVar grown_;          // signalled when a pool's growth ends
  CondVar next_deadline_;  // signalled when the earliest waiter deadline moves closer, or shutdown
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool keep_held_on_stop_ ABSL_GUARDED_BY(mu_) = false;  // KeepHeldOnStop
  // Waiting acquires, keyed by the name they wait for.
  WaitQueue<std::string, AcquireWait> acquires_waiting_ ABSL_GUARDED_BY(mu_);
  // Creates waiting for GrowPools.
  struct PendingCreate {
    CreateCall* call;              // its order, and where its answer goes
    std::string token;             // the caller's session
    CreateWait* waiter = nullptr;  // set when the create may wait for memory (it is `call`)
  };
  std::deque<PendingCreate> pending_creates_ ABSL_GUARDED_BY(mu_);
  CondVar creates_pending_;  // signalled when a create or a growth ahead is queued, and on shutdown
  // Uids whose host segments GrowPools is to grow ahead of need (GrowAhead).
  std::set<uint32_t> grow_ahead_ ABSL_GUARDED_BY(mu_);
  bool warned_growth_ahead_ ABSL_GUARDED_BY(mu_) = false;  // a failed growth ahead was logged
  // Calls to answer once mu_ is released (Lock), with their status.
  struct Finishing {
    PendingCall* call;
    absl::Status status;
    bool granted = false;  // it carries a grant of a call with a request id (PendingCall::Answer)
  };
  std::vector<Finishing> finishing_ ABSL_GUARDED_BY(mu_);
  const absl::Duration cross_cancel_hold_;  // StoreTestHooks::cross_cancel_hold
  const absl::Duration growth_delay_;       // StoreTestHooks::growth_delay
  std::unique_ptr<Catalog> catalog_ ABSL_GUARDED_BY(mu_);
  ChannelGrants grants_ ABSL_GUARDED_BY(mu_);  // of catalog_
  // Creates waiting for memory, keyed by the memory they wait for, first come first served.
  WaitQueue<PoolKey, CreateWait> creates_waiting_ ABSL_GUARDED_BY(mu_);
  // The catalog's release_epoch() at the last retry, and whether a waiting create left the queue
  // since (those behind it may fit now): either makes UnlockAndFinish retry them.
  uint64_t retried_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool retry_creates_ ABSL_GUARDED_BY(mu_) = false;
  // catalog_->FastAcquires() at the last FoldFastAcquires: what metrics_ holds of them.
  uint64_t fast_acquires_counted_ ABSL_GUARDED_BY(mu_) = 0;
  EvictPolicy evict_ = EvictPolicy::kNone;  // set before serving
  const uint64_t session_quota_bytes_;
  const AccessPolicy* const policy_;
  const PeerTable* const peers_;
  // Thread-safe on its own; declared before sessions_, whose charges it must outlive.
  UidLimits uid_limits_;
  SessionTable sessions_ ABSL_GUARDED_BY(mu_);
  Metrics metrics_;  // thread-safe on its own
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_STORE_H_
