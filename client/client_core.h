// ClientCore: what a Client and the tensors it handed out share (the session, the release queue,
// the fast path; the stock shelf and the mappings are parts of their own). Private to the client
// library.
#ifndef TENSORSHM_CLIENT_CLIENT_CORE_H_
#define TENSORSHM_CLIENT_CLIENT_CORE_H_

#include <grpcpp/client_context.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/cancel.h"
#include "client/cuda_state.h"
#include "client/daemon_connection.h"
#include "client/fast_path.h"
#include "client/fork.h"
#include "client/holdings.h"
#include "client/mappings.h"
#include "client/memory_channel.h"
#include "client/segment_map.h"
#include "client/stock_shelf.h"
#include "common/base/mutex.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {

// Deadline of unary calls that do not wait for anything.
inline constexpr absl::Duration kCallTimeout = absl::Seconds(60);
// How long after a call failed UNAVAILABLE its session must still be answering for the failure
// to be taken as the call's own rather than the daemon stopping: a stopping daemon cancels the
// session streams within 2 s (server/main.cc) and tells the fast path at once.
inline constexpr absl::Duration kServingProof = absl::Seconds(3);

// Everything a Client and its tensors share: the channel, the session stream, the release queue,
// the fast path, the stock and the segment mappings. Lives as long as the Client or any tensor from
// it. Thread-safe.
//
// When the session stream breaks (the daemon died or restarted), the sender thread reconnects
// with backoff and re-registers what the client still holds: the tensors of its live leases and
// its unpublished writable tensors. A restarted daemon honours that within its grace period and
// answers with new lease ids, which replace the old ones behind the client-side lease keys.
//
// Every connection to the daemon (the gRPC channel's, made again on each reconnect, and the
// memory channel's) is checked for who serves it before it carries anything: its server's uid
// must be this process's, root's, or `server_uid` (see ConnectToDaemon).
class ClientCore {
 public:
  // `connection`: the first connection, made with ConnectToDaemon's check for `server_uid`.
  // `connect_timeout`: how long opening a session may take (ClientOptions::connect_timeout).
  ClientCore(std::string socket, std::optional<uint32_t> server_uid,
             std::shared_ptr<DaemonConnection> connection, std::string client_name,
             absl::Duration connect_timeout)
      : socket_(std::move(socket)),
        server_uid_(server_uid),
        client_name_(std::move(client_name)),
        connect_timeout_(connect_timeout),
        fork_generation_(ForkGeneration()),
        pid_(getpid()),
        memory_(socket_, server_uid_),
        connection_(std::move(connection)),
        mappings_(
            memory_, [this] { return session_id(); },
            [this](std::function<void()> work) { PopulateLater(std::move(work)); }) {}
  ~ClientCore() { stock_.Drop(); }

  // True in a child process fork() made after this core: nothing of it may be used there.
  bool forked() const { return ForkGeneration() != fork_generation_; }
  // OK in the process that connected; FAILED_PRECONDITION naming both pids in a forked child.
  absl::Status CheckProcess() const;

  // Opens the first session, by `deadline` (a daemon that accepted the connection but does not
  // answer, e.g. stopped, is UNAVAILABLE then); `cancel` (may be null) ends the wait with
  // CANCELLED. A refusal keeps its code; no daemon is UNAVAILABLE.
  absl::Status OpenSession(absl::Time deadline, CancelState* cancel) {
    return Open(/*reattach=*/false, deadline, cancel);
  }

  // Runs `attempt` (a callable returning absl::Status or absl::StatusOr<T>) on the current
  // session and, when it fails because that session ended (the daemon restarted or stopped:
  // UNAVAILABLE, or a refusal of the old session's id), waits for the sender thread to open a new
  // session and runs it again there, until `deadline` or `cancel` (may be null). A daemon that
  // stops cleanly cancels the calls in progress: CANCELLED that `cancel` did not cause counts as
  // the session ending too. Returns the last attempt's result, or UNAVAILABLE naming the socket if
  // no session opened in time.
  //
  // `repeatable`: whether running `attempt` twice is harmless (Stat, List, Acquire, Delete,
  // Create). A call that is not (Publish) is sent only on a session not known to have ended;
  // when it then fails UNAVAILABLE its fate is unknown (the daemon may have committed it before
  // the session ended): it answers UNAVAILABLE saying so, naming `what`, and is not repeated.
  template <typename Attempt>
  auto CallAcrossRestart(std::string_view what, absl::Time deadline, bool repeatable,
                         const CancelState* cancel, Attempt&& attempt) -> decltype(attempt());
  // The deadline CallAcrossRestart gives a call with `timeout`: that long when positive and
  // finite, else (no wait, or no deadline) kCallTimeout.
  static absl::Time RestartDeadline(absl::Duration timeout) {
    return absl::Now() + (timeout > absl::ZeroDuration() && timeout != absl::InfiniteDuration()
                              ? timeout
                              : kCallTimeout);
  }

  // Registers a lease the daemon granted on `tensor_id`; returns the client-side key that
  // QueueRelease takes. Each lease is "outstanding" until released.
  uint64_t AddLease(uint64_t tensor_id, uint64_t lease_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Registers an unpublished writable tensor (outstanding until published or abandoned); returns
  // the client-side key that the other calls take.
  uint64_t AddUnpublished(uint64_t tensor_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon's id of unpublished tensor `key`; DATA_LOSS if a restarted daemon did not take it
  // back (its id may name another tensor now).
  absl::StatusOr<uint64_t> UnpublishedId(uint64_t key) const ABSL_LOCKS_EXCLUDED(mu_);
  void Published(uint64_t key) ABSL_LOCKS_EXCLUDED(mu_);
  // Queue a lease release / an abandoned writable tensor for the sender thread. O(1), never
  // blocks on I/O.
  void QueueRelease(uint64_t key) noexcept ABSL_LOCKS_EXCLUDED(mu_);
  void QueueAbandon(uint64_t key) noexcept ABSL_LOCKS_EXCLUDED(mu_);
  // OK while the daemon holds lease `key` for this client; DATA_LOSS once a restarted daemon did
  // not take it back.
  absl::Status LeaseStatus(uint64_t key) const ABSL_LOCKS_EXCLUDED(mu_);

  // The session's fast path, or nullptr (not set up, or the daemon does not offer one).
  std::shared_ptr<FastPath> fast_path() const ABSL_LOCKS_EXCLUDED(mu_);
  // A lease slot of `fast` was taken / is given back (its tensor's deleter). The slot is
  // cleared with one store; once `fast` was retired, the lease it was turned into is released.
  void PageLeaseTaken() { page_leases_.fetch_add(1, std::memory_order_relaxed); }
  void ReleasePageLease(FastPath& fast, uint32_t page_slot) noexcept ABSL_LOCKS_EXCLUDED(mu_);
  // LeaseStatus of a page lease.
  absl::Status PageLeaseStatus(const FastPath& fast, uint32_t page_slot) const;
  // A memory channel request for the current session (Create, Publish); failing ChannelNotHad when
  // the channel cannot be had (the caller then uses the RPC), else the daemon's answer. A create's
  // answer may carry the writable descriptor of a segment this session had not been granted
  // (ChannelResponse.attached_segment): it is mapped here, as Mappings::Buffer would have asked for
  // it. Any other descriptor that came with the answer is closed. `wait` and `cancel` as
  // MemoryChannel::Exchange's (a create that waits for memory).
  absl::StatusOr<v1::ChannelResponse> Exchange(v1::ChannelRequest& request,
                                               absl::Duration wait = absl::ZeroDuration(),
                                               CancelState* cancel = nullptr) {
    UniqueFd attached;
    absl::StatusOr<v1::ChannelResponse> answer =
        memory_.Exchange(session_id(), request, &attached, wait, cancel);
    if (answer.ok() && answer->has_attached_segment() && attached.valid()) {
      mappings_.AdoptWritable(answer->attached_segment(), std::move(attached));
    }
    return answer;
  }
  // Tells the daemon that a publish follows once `length` bytes are filled (ChannelExpect).
  void ExpectFill(uint64_t length);

  // Maps and puts on the shelf what the daemon stocked for the current session (populated in
  // the background); what cannot be mapped is left to the session's end.
  void AddStock(const google::protobuf::RepeatedPtrField<v1::StockedBuffer>& stocked);
  // Buffers the daemon made ahead of need, mapped writable (AddStock puts them there).
  StockShelf& stock() { return stock_; }
  // This client's views of the daemon's memory.
  Mappings& mappings() { return mappings_; }

  // Starts the sender thread (SendReleases), which holds `self` (this core) until it ends. Called
  // once, by Connect, after the session opened.
  void StartSender(std::shared_ptr<ClientCore> self) {
    sender_ = std::thread(&ClientCore::SendReleases, this, std::move(self));
  }
  // The Client is gone (not in a forked child): with nothing outstanding, waits for the sender to
  // close the session and exit; else the sender keeps the session open until the tensors'
  // deleters ran, and then ends by itself.
  void StopSender() ABSL_LOCKS_EXCLUDED(mu_) {
    if (CloseClient()) {
      sender_.join();
    } else {
      sender_.detach();
    }
  }
  // The sender's batch `request` (a release), sent and answered: over the memory channel, or
  // the session stream when no channel can be had. False when the daemon is gone or the session
  // ended (the stream is then finished).
  bool SendBatch(v1::SessionRequest& request, v1::ReleaseAck* ack) ABSL_LOCKS_EXCLUDED(mu_);
  // The sender thread's body; returns once the Client is gone and no tensor is outstanding.
  void SendReleases(std::shared_ptr<ClientCore> self);
  // Tells the sender the Client is gone; true if nothing is outstanding (it will exit soon).
  bool CloseClient() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Flush() ABSL_LOCKS_EXCLUDED(mu_);

  // Names the current session in `context` (and sets its deadline); returns the session's token.
  std::string PrepareContext(grpc::ClientContext& context, absl::Duration timeout) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // A fresh id for a call the daemon may have to settle (AcquireRequest.request_id,
  // CreateRequest.request_id): unique over the client's life, so never reused in a session.
  uint64_t NextRequestId() { return next_request_id_.fetch_add(1, std::memory_order_relaxed); }
  // Queues a settle of call `request_id`, made on session `session` (PrepareContext's token),
  // whose answer this client did not take: the daemon gives back what it granted the call (see
  // ReleaseBatch.settled_request_ids). Dropped if that session ended (what it granted went with
  // it). O(1), never blocks on I/O; sent with the next batch (Flush sends it).
  void QueueSettle(const std::string& session, uint64_t request_id) noexcept
      ABSL_LOCKS_EXCLUDED(mu_);
  // The current connection's stub (held by the caller for its call: a reconnect may replace it).
  std::shared_ptr<v1::TensorShm::Stub> stub() const ABSL_LOCKS_EXCLUDED(connection_mu_) {
    return connection()->stub();
  }
  SegmentMap& segments() { return mappings_.segments(); }
  CudaState& cuda() { return mappings_.cuda(); }
  // Destroys the ready events of tensors the daemon no longer holds, once there are enough of
  // them to be worth a look through the fast path's view of the catalog (without a fast path,
  // they wait for the next session that has one). Cheap when there are few.
  void SweepReadyEvents() ABSL_LOCKS_EXCLUDED(mu_);
  // The session's secret token, sent with every call: never shown (logs, messages, repr).
  std::string session_id() const ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon's number for the session (SessionOpened.session_number), for display.
  uint64_t session_number() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t daemon_instance() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& socket() const { return socket_; }

 private:
  bool SenderDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return client_closed_ && holdings_.Drained() &&
           page_leases_.load(std::memory_order_acquire) == 0;
  }
  // Queues `work` (populating pages) for the sender thread.
  void PopulateLater(std::function<void()> work) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    to_populate_.push_back(std::move(work));
    work_.Signal();
  }
  // After a session opened: maps its fast path (without one, acquires use the RPC).
  void SetUpFastPath() ABSL_LOCKS_EXCLUDED(mu_);
  // Before re-registering with a restarted daemon: the old session's page leases become
  // leases in holdings_, re-registered like the others.
  void RetireFastPath() ABSL_LOCKS_EXCLUDED(mu_);
  // Opens a session stream; with `reattach`, asks the daemon to take back what this client holds.
  // UNAVAILABLE if the daemon has not answered by `deadline`; CANCELLED when `cancel` (may be
  // null) is.
  absl::Status Open(bool reattach, absl::Time deadline, CancelState* cancel)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Counts sessions opened: a call notes it before running, to tell a restart from its answer.
  uint64_t session_generation() const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return generation_;
  }
  // True once session `generation` is known to have ended: a newer one opened, the sender saw
  // its stream break, or the daemon hung up its connection (`look`: poll the connection too).
  bool SessionEnded(uint64_t generation, bool look) const ABSL_LOCKS_EXCLUDED(mu_);
  // How a wait for the session after `generation` ended (WaitForSession).
  enum class SessionWait {
    kNewSession,  // a newer session opened
    kServing,     // session `generation` itself is still served (see WaitForSession)
    kGaveUp,      // `deadline` passed or `cancel` was cancelled
    kRefused,     // an attempt made during the wait was refused (PERMISSION_DENIED): the daemon
                  // serving the socket now is not trusted, or does not admit this process
  };
  // Waits until a session newer than `generation` is open, or until `deadline` or `cancel`.
  // Meanwhile the sender is asked to look at the stream and to try reconnecting at least every
  // kSessionPoll, instead of backing off. With `serving_proof` finite, also ends (kServing) once
  // session `generation` answered a probe sent `serving_proof` after the wait began, with the
  // fast path (if any) saying the daemon serves: the call's failure was not the session ending.
  // A reconnect attempt refused while it waits ends it at once (kRefused): waiting out the
  // deadline would not change whom the socket's path leads to.
  SessionWait WaitForSession(uint64_t generation, absl::Time deadline, const CancelState* cancel,
                             absl::Duration serving_proof = absl::InfiniteDuration())
      ABSL_LOCKS_EXCLUDED(mu_);
  // For a call of `what` that found no new session: UNAVAILABLE by its deadline, or the last
  // attempt's PERMISSION_DENIED, said as such.
  absl::Status NoSession(std::string_view what) const ABSL_LOCKS_EXCLUDED(mu_);
  // After the stream broke: reopens a session, with backoff. False if the sender should exit.
  bool Reconnect() ABSL_LOCKS_EXCLUDED(mu_);
  std::shared_ptr<DaemonConnection> connection() const ABSL_LOCKS_EXCLUDED(connection_mu_) {
    MutexLock lock(&connection_mu_);
    return connection_;
  }

  const std::string socket_;
  const std::optional<uint32_t> server_uid_;
  const std::string client_name_;
  const absl::Duration connect_timeout_;
  const uint64_t fork_generation_;
  const pid_t pid_;
  MemoryChannel memory_;
  // The gRPC connection; replaced only by the thread that opens sessions, with the session.
  mutable Mutex connection_mu_;  // taken after mu_, never before
  std::shared_ptr<DaemonConnection> connection_ ABSL_GUARDED_BY(connection_mu_);
  // The session stream; replaced only by the thread that opens sessions (Connect, then sender).
  std::unique_ptr<grpc::ClientContext> session_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  Mappings mappings_;

  mutable Mutex mu_;
  CondVar work_;   // the sender has something to do
  CondVar acked_;  // a batch was acknowledged, or the stream broke
  std::string session_id_ ABSL_GUARDED_BY(mu_);
  uint64_t session_number_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // sessions opened so far
  CondVar session_opened_;  // generation_ changed, or a reconnect attempt failed
  uint64_t daemon_instance_ ABSL_GUARDED_BY(mu_) = 0;
  // Leases and unpublished tensors by client-side key, and what is queued for the sender.
  Holdings holdings_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> next_request_id_{1};
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t acked_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status rejection_ ABSL_GUARDED_BY(mu_);
  // Why the last reconnect failed (a refused server is worth telling the caller of Flush).
  absl::Status reconnect_error_ ABSL_GUARDED_BY(mu_);
  uint64_t failed_reconnects_ ABSL_GUARDED_BY(mu_) = 0;  // counts attempts that failed
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  bool client_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool flush_requested_ ABSL_GUARDED_BY(mu_) = false;  // send a batch even if empty
  std::shared_ptr<FastPath> fast_ ABSL_GUARDED_BY(mu_);
  // Populating for the sender thread to do, off the callers' paths: new read-only segment
  // mappings (Mappings::HostSegment) and stocked buffers (AddStock).
  std::vector<std::function<void()>> to_populate_ ABSL_GUARDED_BY(mu_);
  StockShelf stock_;
  // Leases held in lease page slots: counted without the mutex (a release is one store).
  std::atomic<int64_t> page_leases_{0};
  std::atomic<bool> closing_{false};  // client_closed_, for releases that do not lock
  // Sends batched releases on the session stream; started and stopped by the Client's owner
  // (StartSender, StopSender), never touched by the sender itself. In a forked child it is the
  // parent's, and the core is kept forever (KeepForever) with it.
  std::thread sender_;
};

namespace internal {
inline const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& result) {
  return result.status();
}
}  // namespace internal

template <typename Attempt>
auto ClientCore::CallAcrossRestart(std::string_view what, absl::Time deadline, bool repeatable,
                                   const CancelState* cancel, Attempt&& attempt)
    -> decltype(attempt()) {
  while (true) {
    const uint64_t generation = session_generation();
    // Not sent on a session known to have ended: what is sent there has an unknown fate.
    if (!repeatable && !forked() && SessionEnded(generation, /*look=*/true)) {
      if (WaitForSession(generation, deadline, cancel) != SessionWait::kNewSession) {
        return NoSession(what);
      }
      continue;
    }
    auto result = attempt();
    const absl::Status& status = internal::StatusOf(result);
    // A forked child has no sender to reconnect: its inherited client only refuses.
    if (forked()) return result;
    // UNAVAILABLE: the daemon is gone or stopping. CANCELLED that the caller did not ask for: a
    // daemon stopping cleanly cancels the calls in progress. FAILED_PRECONDITION after the
    // session ended: the old session's id reached the new daemon (which does not know it).
    const bool dropped = absl::IsUnavailable(status) ||
                         (absl::IsCancelled(status) && (cancel == nullptr || !cancel->cancelled()));
    if (status.ok() || !(dropped || (absl::IsFailedPrecondition(status) &&
                                     SessionEnded(generation, /*look=*/true)))) {
      return result;
    }
    if (!repeatable) {
      if (!dropped) return result;  // refused before it was carried out
      return absl::UnavailableError(absl::StrCat(
          absl::string_view(what.data(), what.size()),
          ": fate unknown: the session with tensorshmd at unix:", socket_,
          " ended (the daemon stopped, died or restarted) while the call was in flight, so the "
          "daemon may or may not have carried it out; not repeated automatically, since doing it "
          "twice is not harmless: check before retrying (",
          status.message(), ")"));
    }
    // A daemon that serves the session all along refused this one call (its memory channel
    // connection, say, past --uid-connections): the failure is answered, not waited out.
    const SessionWait wait = WaitForSession(generation, deadline, cancel, kServingProof);
    if (wait == SessionWait::kRefused) return NoSession(what);
    if (wait != SessionWait::kNewSession) return result;
  }
}

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_CLIENT_CORE_H_
