// The gRPC service: sessions, create / publish / acquire / delete / list / stat.
#ifndef TENSORSHM_SERVER_RPC_SERVICE_H_
#define TENSORSHM_SERVER_RPC_SERVICE_H_

#include <deque>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "server/catalog/catalog.h"
#include "server/core/access.h"
#include "server/core/session.h"
#include "server/core/wait_queue.h"
#include "server/ops/eviction.h"
#include "server/ops/metrics.h"
#include "server/ops/uid_limits.h"
#include "server/rpc/memory_channel.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {

inline constexpr char kSessionMetadataKey[] = "tensorshm-session";

// Thread-safe. gRPC's callback API: no call holds a thread while it waits. Unary calls are
// answered on the gRPC thread that runs them (under mu_ for the catalog and sessions), except a
// create that needs a new pool segment, which GrowPools answers once it is made (GrowPools is
// the only thread that makes segments once the service runs, also ahead of need: see
// GrowAhead); a Session
// stream is a reactor that reads one request, answers it and reads the next; an Acquire that
// waits for a publish is a reactor on its name's waiter list, finished by that publish, its
// deadline (ExpireWaiters), its cancellation, its session's end or BeginShutdown. Reactors are
// always finished after mu_ is released (gRPC may run OnCancel and OnDone inline).
class TensorShmService final : public v1::TensorShm::CallbackService {
 public:
  // `session_quota_bytes`: most bytes of unpublished buffers one session may hold; 0: no limit.
  // `policy` and `peers` (both outliving the service) decide who may call; null admits all.
  // `uid_limits`: what all sessions of one uid may hold together (--uid-*); {}: no limits.
  TensorShmService(std::unique_ptr<Catalog> catalog, uint64_t session_quota_bytes = 0,
                   const AccessPolicy* policy = nullptr, const PeerTable* peers = nullptr,
                   const UidLimitsConfig& uid_limits = {});
  ~TensorShmService();

  // --evict: what a create that finds its pool full may do first. Call before serving.
  void set_evict_policy(EvictPolicy policy) { evict_ = policy; }

  // --keep-segments, called as the stop begins: the shm objects outlive this daemon, so from now
  // on a session that ends keeps what it holds where a crash would leave it (its leases, on
  // unbound tensors too, and its unpublished buffers stay in the control segment) for its client
  // to take back in the next daemon's recovery grace.
  void KeepHeldOnStop() ABSL_LOCKS_EXCLUDED(mu_);

  // Finishes acquire waiters and waiting creates (and makes new waits fail) with UNAVAILABLE, and
  // ends ExpireWaiters, GrowPools and Housekeep; call before stopping the server so that no call
  // outlives it.
  void BeginShutdown() ABSL_LOCKS_EXCLUDED(mu_);

  // Finishes acquire waiters whose deadline passed with DEADLINE_EXCEEDED, and waiting creates
  // whose deadline passed with RESOURCE_EXHAUSTED, each when its time comes, until BeginShutdown.
  // Runs on a thread of its own.
  void ExpireWaiters() ABSL_LOCKS_EXCLUDED(mu_);

  // Answers the gRPC creates that need a pool to grow, one at a time, until BeginShutdown (then
  // those still queued get UNAVAILABLE): making a segment takes long, and gRPC runs every call
  // of the service on a few threads, none of which may wait for it. When no create waits for it,
  // grows the host pool ahead of need for the uids GrowAhead named. Runs on a thread of its own.
  void GrowPools() ABSL_LOCKS_EXCLUDED(mu_);

  // After a restart's grace period: frees unbound tensors nobody came back for.
  int ExpireUnbound();

  // Runs the fast path's housekeeping until BeginShutdown: every kHeartbeatIntervalNs, stores
  // the heartbeat in the index and frees retired tensors whose lease page slots were cleared.
  void Housekeep() ABSL_LOCKS_EXCLUDED(mu_);
  // --keep-segments: leave the shm objects for the next daemon with this prefix.
  void KeepSegments();

  // Answers one memory channel request (see ChannelRequest in the .proto): binds `connection`
  // to a session opened by the same process, grants one host segment's descriptor or a fast
  // path part, or creates / publishes for the bound session. Refusals are in the response's
  // code and message.
  ChannelReply HandleChannel(ChannelConnection& connection, const v1::ChannelRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  // What Stat answers, read as Stat reads it (under mu_, briefly), for --metrics. Also folds the
  // fast path acquires counted since the last fold into metrics(), so that the figures rendered
  // after it hold every acquire made before the call.
  v1::StatResponse StatSnapshot() ABSL_LOCKS_EXCLUDED(mu_);
  // The counters and histogram of --metrics (thread-safe on their own).
  const Metrics& metrics() const { return metrics_; }
  Metrics& metrics() { return metrics_; }

  grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* Session(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Create(grpc::CallbackServerContext* context,
                                   const v1::CreateRequest* request,
                                   v1::CreateResponse* response) override;
  grpc::ServerUnaryReactor* Publish(grpc::CallbackServerContext* context,
                                    const v1::PublishRequest* request,
                                    v1::PublishResponse* response) override;
  grpc::ServerUnaryReactor* Acquire(grpc::CallbackServerContext* context,
                                    const v1::AcquireRequest* request,
                                    v1::AcquireResponse* response) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* context,
                                   const v1::DeleteRequest* request,
                                   v1::DeleteResponse* response) override;
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* context,
                                 const v1::ListRequest* request,
                                 v1::ListResponse* response) override;
  grpc::ServerUnaryReactor* Stat(grpc::CallbackServerContext* context,
                                 const v1::StatRequest* request,
                                 v1::StatResponse* response) override;
  // service_sessions.cc
  grpc::ServerUnaryReactor* Sessions(grpc::CallbackServerContext* context,
                                     const v1::SessionsRequest* request,
                                     v1::SessionsResponse* response) override;

 private:
  class SessionReactor;  // service_reactors.cc
  class Waiter;          // service_reactors.cc
  class CreateWaiter;    // service_create_waiters.cc

  // The memory a create draws from: a pool, and on the host pool the uid (each uid's buffers
  // take segments of their own). Waiting creates are served in order per key.
  struct PoolKey {
    int32_t device_type = 0;
    int32_t device_id = 0;
    uint32_t uid = 0;  // 0 for CUDA pools
    bool operator<(const PoolKey& other) const {
      return std::tie(device_type, device_id, uid) <
             std::tie(other.device_type, other.device_id, other.uid);
    }
    bool operator==(const PoolKey& other) const {
      return device_type == other.device_type && device_id == other.device_id && uid == other.uid;
    }
    template <typename H>
    friend H AbslHashValue(H h, const PoolKey& key) {
      return H::combine(std::move(h), key.device_type, key.device_id, key.uid);
    }
  };

  // ---- The frame of every unary call (service.cc) ----

  // How Unary() opens and closes a call.
  struct UnaryFrame {
    MetricOp op = MetricOp::kCount;
    bool counted = true;        // false: the call is not counted in metrics_ (Sessions)
    bool needs_session = true;  // the body needs the caller's session (CallerSession)
    // The call's reactor; null: the context's default reactor.
    grpc::ServerUnaryReactor* reactor = nullptr;
    // The call's request id (0: none): an OK answer to it carries a grant (FinishGranting).
    uint64_t request_id = 0;
    // A check of the request that needs no lock, answered (if not OK) right after Admit.
    absl::Status checked = absl::OkStatus();
  };
  // What a unary call's body is given, under mu_.
  struct UnaryCall {
    const PeerCredentials& peer;            // what Admit returned for the call
    grpc::ServerUnaryReactor* reactor;      // the call's, finished by Unary unless answered_later
    tensorshm::Session* session = nullptr;  // the caller's if UnaryFrame::needs_session, else null
    // Set by a body that leaves the call to whoever takes it off a queue (GrowPools, a waiter
    // list), who then counts it and finishes it; Unary does neither.
    bool answered_later = false;
  };
  // The frame every unary handler shares: Admit, frame.checked, ServiceLock, CallerSession (if
  // frame.needs_session), `body`; then, with mu_ released, counts the answer in metrics_ and
  // finishes the reactor with it (FinishGranting). Returns the reactor, for gRPC.
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, const UnaryFrame& frame,
                                  absl::FunctionRef<absl::Status(UnaryCall&)> body)
      ABSL_LOCKS_EXCLUDED(mu_);
  // StatSnapshot's work, under mu_.
  void StatLocked(v1::StatResponse* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Holds mu_ for its scope; on release, finishes the reactors queued in finishing_ meanwhile,
  // after unlocking.
  class ABSL_SCOPED_LOCKABLE ServiceLock {
   public:
    explicit ServiceLock(TensorShmService* service) ABSL_EXCLUSIVE_LOCK_FUNCTION(service->mu_)
        : service_(service) {
      service_->mu_.lock();
    }
    ~ServiceLock() ABSL_UNLOCK_FUNCTION() { service_->UnlockAndFinish(); }
    ServiceLock(const ServiceLock&) = delete;
    ServiceLock& operator=(const ServiceLock&) = delete;

   private:
    TensorShmService* service_;
  };
  // Releases mu_, then finishes what was queued in finishing_.
  void UnlockAndFinish() ABSL_UNLOCK_FUNCTION(mu_);

  // Queues `waiter`, already off every list, to be finished with `status` once mu_ is released.
  void FinishLater(Waiter* waiter, grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Waiting acquires. AddWaiter puts a waiter of `session` on its name's list, its session's list
  // and (with a finite deadline) the deadline queue; RemoveWaiter takes it off all three.
  // AddWaiter is where a limit on waiting acquires (per uid) is checked: an error refuses the
  // wait and the waiter is not added.
  absl::Status AddWaiter(Waiter* waiter, const tensorshm::Session& session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveWaiter(Waiter* waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives every waiter for `name` (just published) a lease on it and queues it to finish.
  void WakeWaiters(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A waiter's OnCancel: CANCELLED, unless it was finished already.
  void CancelWaiter(Waiter* waiter) ABSL_LOCKS_EXCLUDED(mu_);
  // A waiter's OnDone (`cancelled`: its call failed before the client had the answer): drops
  // the lease the answer carried, if any.
  void WaiterDone(Waiter* waiter, bool cancelled) ABSL_LOCKS_EXCLUDED(mu_);
  // Answers `waiter` at once or puts it on the lists (Acquire's work); returns it, for gRPC.
  grpc::ServerUnaryReactor* StartWaiter(Waiter* waiter, grpc::CallbackServerContext* context)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A session stream's `open`: the new session's SessionOpened, or the refusal.
  absl::StatusOr<v1::SessionResponse> OpenSession(const grpc::CallbackServerContext& context,
                                                  const PeerCredentials& peer,
                                                  const v1::SessionOpen& open, uint64_t* session_id,
                                                  std::string* token) ABSL_LOCKS_EXCLUDED(mu_);
  // A session stream's `release`: the acknowledgement; nullopt if the session is gone.
  std::optional<v1::SessionResponse> SessionRelease(const std::string& token,
                                                    const v1::ReleaseBatch& batch)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Fails every waiter of the session `session_id` (ending) as a call naming `token` would be.
  void FailSessionWaiters(uint64_t session_id, const std::string& token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A lease of `session` on `tensor`, described in `response` (an Acquire's answer).
  void Grant(tensorshm::Session& session, const Tensor& tensor, v1::AcquireResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // CreateFor for the session with `token` that grows a pool when it must: the segment is made
  // with mu_ released, then the create is tried again, the session looked up again (it may have
  // ended meanwhile: `gone` is returned then). Blocks while another caller grows the pool, and
  // while it grows one: for GrowPools only.
  // `pool_full`, if set, as CreateFor's.
  absl::Status CreateGrowing(const std::string& token, const absl::Status& gone,
                             const v1::CreateRequest& request, v1::CreateResponse* response,
                             bool* pool_full = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

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
  // The caller's credentials if the policy admits it; PERMISSION_DENIED otherwise.
  absl::StatusOr<PeerCredentials> Admit(const grpc::ServerContextBase& context) const;
  // The session named by the call's metadata, for `caller` (what Admit returned for the call).
  // INVALID_ARGUMENT if the metadata is missing, FAILED_PRECONDITION if no open session has that
  // token (NoSession), PERMISSION_DENIED if `caller` is not the process that opened it
  // (Session::CheckCaller).
  absl::StatusOr<tensorshm::Session*> CallerSession(const grpc::ServerContextBase& context,
                                                    const PeerCredentials& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static absl::Status NoSession(const std::string& token);
  // Ends `session`: drops its leases, frees its unpublished tensors, fails its waiting acquires,
  // forgets it.
  void CloseSession(uint64_t session_id, const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);
  // A reconnecting client's SessionOpen: leases and unpublished tensors it held before the
  // daemon restarted, taken back where the catalog allows; the outcome goes into `opened`.
  void Reattach(tensorshm::Session& session, const v1::SessionOpen& open, v1::SessionOpened* opened)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleReleases(tensorshm::Session& session, const v1::ReleaseBatch& batch,
                      v1::ReleaseAck* ack) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // After a create of call `request_id` by the session with `token` made what `response` carries:
  // kept for a settle (OK), or given back at once if the client settled the call already
  // (CANCELLED), or the session's `gone` if it ended.
  absl::Status KeepCreated(const std::string& token, const absl::Status& gone, uint64_t request_id,
                           const v1::CreateResponse& response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finishes `reactor` with `status`; `granted`: it carries a grant of a call with a request id
  // (held back by cross_cancel_hold_ in tests). REQUIRES: mu_ not held.
  void FinishGranting(grpc::ServerUnaryReactor* reactor, grpc::Status status, bool granted)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Records a new lease of `session` on `tensor` (sealed) and returns its id.
  // REQUIRES: the lease is charged to session.uid_charge already.
  uint64_t AddLease(tensorshm::Session& session, const Tensor& tensor)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The daemon's ordinal of the CUDA device with `uuid`. INVALID_ARGUMENT unless `device` is
  // CUDA and `uuid` 16 bytes, FAILED_PRECONDITION if no pool is on that device.
  absl::StatusOr<int> CudaOrdinalOf(const DLDevice& device, const std::string& uuid) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Describe(const Tensor& tensor, v1::TensorDesc* desc, v1::Location* location) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Create and Publish for `session`, whichever transport asked. A create that needs a new pool
  // segment returns UNAVAILABLE with `growth` saying so (see SegmentGrowth): CreateGrowing.
  // With --evict lru a full pool evicts first (Catalog::CreateEvicting). A create that finds its
  // pool (or the record table) full, or creates waiting for that memory ahead of it (unless
  // `waited`: it is one of them), returns RESOURCE_EXHAUSTED and sets `*pool_full` (if given):
  // it may wait. Quota refusals do not set it.
  absl::Status CreateFor(tensorshm::Session& session, const v1::CreateRequest& request,
                         v1::CreateResponse* response, SegmentGrowth* growth, bool waited = false,
                         bool* pool_full = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED naming the limit and its flag if a buffer for a tensor of `dtype`,
  // `shape`, `strides` on `device` would take `session` past --session-quota or its uid past
  // --uid-quota; OK otherwise, and when the layout is invalid (Catalog::Create says why). Takes
  // and counts nothing: CreateFor asks before it allocates.
  absl::Status CheckCreateQuotas(tensorshm::Session& session, const DLDataType& dtype,
                                 absl::Span<const int64_t> shape, absl::Span<const int64_t> strides,
                                 const DLDevice& device, bool subbyte_padded)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PublishFor(tensorshm::Session& session, const v1::PublishRequest& request,
                          v1::PublishResponse* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // need (CreateRequest.stock), fewer when the pool is short; none under a session quota. Stock
  // never grows a pool: it takes what the segments made so far hold.
  void Stock(tensorshm::Session& session, uint64_t length, uint32_t count,
             google::protobuf::RepeatedPtrField<v1::StockedBuffer>* stocked)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status DeleteFor(const tensorshm::Session& session, const v1::DeleteRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The descriptor of fast path part `request.part()` for `session`.
  absl::StatusOr<int> GrantFastPath(const tensorshm::Session& session,
                                    const v1::FastPathRequest& request, v1::FastPathGrant* grant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The descriptor of host segment `request.segment_id` for `session`, as the channel grants it.
  absl::StatusOr<int> GrantSegment(const tensorshm::Session& session,
                                   const v1::SegmentRequest& request, v1::SegmentGrant* grant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Creates that wait for memory (service_create_waiters.cc) ----

  // Create's work for a create with wait_ms != 0: its reactor, answered at once when it can be
  // (or queued for GrowPools), else put on the queue of waiting creates.
  grpc::ServerUnaryReactor* CreateWaiting(grpc::CallbackServerContext* context,
                                          const v1::CreateRequest* request,
                                          v1::CreateResponse* response) ABSL_LOCKS_EXCLUDED(mu_);
  // Queues `waiter` of `session` (whose create found its pool full with `refusal`), charged to
  // its uid's --uid-waiters; an error refuses the wait and queues nothing.
  absl::Status AddCreateWaiter(CreateWaiter* waiter, const tensorshm::Session& session,
                               const absl::Status& refusal) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveCreateWaiter(CreateWaiter* waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tries the waiting creates again, in order; once one for a PoolKey still does not fit, the
  // later ones for that key wait on (first come, first served). Finishes those that are done.
  void RetryWaitingCreates() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finishes the waiting creates whose deadline is not after `now`; true if there were any.
  bool ExpireCreates(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finishes the waiting creates of session `session_id` (ending), or all of them, with `status`.
  void FailSessionCreates(uint64_t session_id, const std::string& token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailWaitingCreates(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A waiting create's OnCancel: CANCELLED, unless it was finished already.
  void CancelCreate(CreateWaiter* waiter) ABSL_LOCKS_EXCLUDED(mu_);
  // A waiting create's OnDone: a create that succeeded but whose client gave up on the call
  // frees its buffers (nobody knows their ids).
  void CreateWaiterDone(CreateWaiter* waiter, bool cancelled) ABSL_LOCKS_EXCLUDED(mu_);
  // Queues `waiter`, off the queue, to be finished with `status` once mu_ is released, and counts
  // its answer (metrics_).
  void FinishCreate(CreateWaiter* waiter, grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // GrowPools' answer `status` to `waiter`: finished, or queued if its pool was full.
  void FinishGrownCreate(CreateWaiter* waiter, const absl::Status& status, bool pool_full)
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
  WaitQueue<std::string, Waiter> acquires_waiting_ ABSL_GUARDED_BY(mu_);
  // gRPC creates waiting for GrowPools.
  struct PendingCreate {
    grpc::ServerUnaryReactor* reactor;
    std::string token;  // the caller's session
    const v1::CreateRequest* request;
    v1::CreateResponse* response;
    CreateWaiter* waiter = nullptr;  // set when the create may wait for memory
  };
  std::deque<PendingCreate> pending_creates_ ABSL_GUARDED_BY(mu_);
  CondVar creates_pending_;  // signalled when a create or a growth ahead is queued, and on shutdown
  // Uids whose host segments GrowPools is to grow ahead of need (GrowAhead).
  std::set<uint32_t> grow_ahead_ ABSL_GUARDED_BY(mu_);
  bool warned_growth_ahead_ ABSL_GUARDED_BY(mu_) = false;  // a failed growth ahead was logged
  // Reactors to finish once mu_ is released (ServiceLock), with their status.
  struct Finishing {
    grpc::ServerUnaryReactor* reactor;
    grpc::Status status;
    bool granted = false;  // it carries a grant of a call with a request id (see FinishGranting)
  };
  std::vector<Finishing> finishing_ ABSL_GUARDED_BY(mu_);
  // Test only (TENSORSHMD_TEST_CROSS_CANCEL_MS, read at start): non-zero, every answer granting
  // something to a call with a request id is sent this much later, and the call's cancellation
  // no longer gives the grant back (WaiterDone, CreateWaiterDone), as when the answer crossed the
  // client's cancel; only the client's settle does. The fast path is not offered either, so that
  // acquires take the RPC. Zero in production.
  static absl::Duration CrossCancelHoldFromEnvironment();
  const absl::Duration cross_cancel_hold_ = CrossCancelHoldFromEnvironment();
  // Test only (TENSORSHMD_TEST_GROWTH_DELAY_MS, read at start): non-zero, every growth of a pool
  // (GrowUnlocked) sleeps this long, with mu_ released, before it makes its segment, as a slow
  // posix_fallocate or cuMemAlloc would. Zero in production.
  static absl::Duration GrowthDelayFromEnvironment();
  const absl::Duration growth_delay_ = GrowthDelayFromEnvironment();
  std::unique_ptr<Catalog> catalog_ ABSL_GUARDED_BY(mu_);
  // Creates waiting for memory, keyed by the memory they wait for, first come first served.
  WaitQueue<PoolKey, CreateWaiter> creates_waiting_ ABSL_GUARDED_BY(mu_);
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

#endif  // TENSORSHM_SERVER_RPC_SERVICE_H_
