#include "client/client_core.h"

#include <grpcpp/alarm.h>
#include <sys/mman.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tensor/grpc_status.h"

namespace tensorshm {
namespace {

constexpr char kSessionMetadataKey[] = "tensorshm-session";

// How often a call waiting for a new session (CallAcrossRestart) has the sender try again.
constexpr absl::Duration kSessionPoll = absl::Milliseconds(100);

// Cancels a stream's context unless disarmed by a deadline: a daemon that accepted the
// connection but does not answer (stopped with SIGSTOP, hung) must not hold a session's opening
// forever, and a sync stream's reads take no deadline of their own. The timer is a gRPC alarm,
// run on gRPC's own threads: a thread of ours per opening would be one more thread to start in
// a forked child, where ThreadSanitizer cannot tell it from the parent's threads.
class OpenDeadline {
 public:
  OpenDeadline(grpc::ClientContext* context, absl::Time deadline) {
    if (deadline == absl::InfiniteFuture()) return;
    armed_ = true;
    alarm_.Set(absl::ToChronoTime(deadline), [this, context](bool expired) {
      MutexLock lock(&mu_);
      if (expired) {
        fired_ = true;
        context->TryCancel();
      }
      done_ = true;
      ran_.SignalAll();
    });
  }
  ~OpenDeadline() { Disarm(); }
  OpenDeadline(const OpenDeadline&) = delete;
  OpenDeadline& operator=(const OpenDeadline&) = delete;

  // Stops the timer and waits until its callback ran (cancelled, or fired): the callback uses
  // the context, which dies after this. True if it had fired (the context was cancelled).
  bool Disarm() {
    if (!armed_) return false;
    alarm_.Cancel();
    MutexLock lock(&mu_);
    while (!done_) ran_.Wait(&mu_);
    return fired_;
  }

 private:
  grpc::Alarm alarm_;
  bool armed_ = false;
  Mutex mu_;
  CondVar ran_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
};

// The lease id a page lease carries in holdings_ after a restart turned it into a reattached one,
// until the new daemon answers with the real id.
constexpr uint64_t kPageLeaseId = ~uint64_t{0};

}  // namespace

absl::Status ClientCore::Open(bool reattach, absl::Time deadline, CancelState* cancel) {
  // The session's stream runs on `connection`, so it is declared before the stream's context.
  std::shared_ptr<DaemonConnection> connection;
  if (reattach) {
    // A new connection, checked like the first: whoever serves the socket now may not be the
    // daemon that served it before.
    absl::StatusOr<std::shared_ptr<DaemonConnection>> made =
        DaemonConnection::Connect(socket_, server_uid_);
    if (!made.ok()) return made.status();
    connection = *std::move(made);
  } else {
    connection = this->connection();
  }
  auto context = std::make_unique<grpc::ClientContext>();
  v1::SessionRequest open;
  open.mutable_open()->set_client_version(TENSORSHM_VERSION);
  open.mutable_open()->set_pid(getpid());
  open.mutable_open()->set_client_name(client_name_);
  Holdings::Reattach asked;
  if (reattach) {
    RetireFastPath();
    stock_.Drop();
    MutexLock lock(&mu_);
    asked = holdings_.ForReattach(open.mutable_open());
  }
  ScopedWait waiting(cancel, CancelState::Wait{.context = context.get()});
  if (!waiting.registered()) return absl::CancelledError("connect: the wait was cancelled");
  auto stream = connection->stub()->Session(context.get());
  v1::SessionResponse opened;
  OpenDeadline timer(context.get(), deadline);
  const bool answered = stream->Write(open) && stream->Read(&opened) && opened.has_opened();
  const bool timed_out = timer.Disarm();
  if (!answered) {
    stream->WritesDone();
    absl::Status status = FromGrpcStatus(stream->Finish());
    if (cancel != nullptr && cancel->cancelled()) {
      return absl::CancelledError(
          absl::StrCat("connect to tensorshmd at unix:", socket_, ": the wait was cancelled"));
    }
    if (timed_out) {
      return absl::UnavailableError(
          absl::StrCat("tensorshmd at unix:", socket_,
                       " accepted the connection but did not open a session "
                       "by the connect timeout (is the daemon stopped or hung?)"));
    }
    // A refusal (PERMISSION_DENIED, ...) keeps its code; a broken connection is UNAVAILABLE.
    const absl::StatusCode code = status.ok() || status.code() == absl::StatusCode::kCancelled ||
                                          status.code() == absl::StatusCode::kDeadlineExceeded
                                      ? absl::StatusCode::kUnavailable
                                      : status.code();
    return absl::Status(code, absl::StrCat("tensorshmd at unix:", socket_,
                                           " did not open a session: ", status.message()));
  }
  const v1::SessionOpened& answer = opened.opened();
  // Mappings of segments this daemon does not serve are not the same memory: they go (each
  // once no tensor of ours uses it). A recovered daemon lists the segments it took back under
  // the instance that made them, so those stay.
  std::set<SegmentKey> live;
  for (const v1::SegmentRef& segment : answer.segments()) {
    live.emplace(segment.segment_instance(), segment.segment_id());
  }
  segments().Retain(live);
  {
    MutexLock lock(&mu_);
    session_id_ = answer.session_id();
    session_number_ = answer.session_number();
    daemon_instance_ = answer.instance_id();
    ++generation_;
    session_opened_.SignalAll();
    if (reattach) {
      // Batches numbered before now went to the old session, which will never acknowledge them
      // (one may have failed on the broken stream): Flush must not wait for them.
      acked_sequence_ = next_sequence_ - 1;
      acked_.SignalAll();
      // Leases and tensors the daemon did not take back are gone: their releases are dropped, and
      // Flush reports the loss (the memory is no longer reserved for them).
      const std::vector<uint64_t> lost = holdings_.Reattached(asked, answer);
      // A loss outranks a refused release: it is what the caller must not miss.
      if (!lost.empty() && !absl::IsDataLoss(rejection_)) {
        rejection_ = absl::DataLossError(absl::StrCat(
            "tensorshmd at unix:", socket_, " restarted (instance ", answer.instance_id(),
            ") and did not take back ", lost.size(), " tensors this client held (tensor ids ",
            absl::StrJoin(lost, ", "),
            "): their memory is no longer reserved for them; acquire or create them again"));
      }
    }
    // The old stream (finished) goes before the context it was made with, and both before the
    // connection they ran on.
    stream_ = std::move(stream);
    session_context_ = std::move(context);
    connected_ = true;
    reconnect_error_ = absl::OkStatus();
    // The old connection goes with `connection` on return, outside the locks.
    MutexLock connection_lock(&connection_mu_);
    connection_.swap(connection);
  }
  SetUpFastPath();
  return absl::OkStatus();
}

void ClientCore::SetUpFastPath() {
  const std::string token = session_id();
  absl::StatusOr<std::shared_ptr<FastPath>> fast = FastPath::Open(memory_, token);
  MutexLock lock(&mu_);
  // A session that ended meanwhile gets no fast path: the next one will.
  if (fast.ok() && session_id_ == token) fast_ = *std::move(fast);
}

void ClientCore::RetireFastPath() {
  std::shared_ptr<FastPath> old;
  {
    MutexLock lock(&mu_);
    old = std::move(fast_);
  }
  if (old == nullptr) return;
  const int converted = old->Retire([this](uint64_t tensor_id) {
    MutexLock lock(&mu_);
    return holdings_.AddLease(tensor_id, kPageLeaseId);
  });
  page_leases_.fetch_sub(converted, std::memory_order_acq_rel);
}

void ClientCore::SweepReadyEvents() {
  // Only when enough events piled up: one look reads every record of the catalog, so at least
  // record_count / kRecordsPerSweptEvent events must be there to pay for it.
  constexpr size_t kRecordsPerSweptEvent = 256;
  if (cuda().ready_event_count() < kMinReadyEventSweep) return;
  std::shared_ptr<FastPath> fast = fast_path();
  if (fast == nullptr) return;
  cuda().SweepReadyEvents(fast->record_count() / kRecordsPerSweptEvent,
                          [&](std::vector<uint64_t>* ids) { fast->HeldTensorIds(ids); });
}

std::shared_ptr<FastPath> ClientCore::fast_path() const {
  MutexLock lock(&mu_);
  return fast_;
}

void ClientCore::ReleasePageLease(FastPath& fast, uint32_t page_slot) noexcept {
  uint64_t key = 0;
  if (!fast.Release(page_slot, &key)) {
    QueueRelease(key);
    return;
  }
  // The sender waits for the last lease of a closed client; only then is it worth a wake-up.
  if (page_leases_.fetch_sub(1, std::memory_order_acq_rel) == 1 &&
      closing_.load(std::memory_order_acquire)) {
    MutexLock lock(&mu_);
    work_.Signal();
  }
}

absl::Status ClientCore::PageLeaseStatus(const FastPath& fast, uint32_t page_slot) const {
  uint64_t key = 0;
  if (fast.ConvertedKey(page_slot, &key)) return LeaseStatus(key);
  return absl::OkStatus();
}

std::string ClientCore::PrepareContext(grpc::ClientContext& context, absl::Duration timeout) const {
  std::string session = session_id();
  context.AddMetadata(kSessionMetadataKey, session);
  if (timeout != absl::InfiniteDuration()) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  return session;
}

void ClientCore::QueueSettle(const std::string& session, uint64_t request_id) noexcept {
  MutexLock lock(&mu_);
  if (session != session_id_) return;  // that session ended, and its grants with it
  holdings_.QueueSettle(request_id);
  work_.Signal();
}

bool ClientCore::SessionEnded(uint64_t generation, bool look) const {
  {
    MutexLock lock(&mu_);
    if (generation_ != generation || !connected_) return true;
  }
  return look && connection()->Broken();
}

ClientCore::SessionWait ClientCore::WaitForSession(uint64_t generation, absl::Time deadline,
                                                   const CancelState* cancel,
                                                   absl::Duration serving_proof) {
  MutexLock lock(&mu_);
  const absl::Time began = absl::Now();
  const uint64_t failed_before = failed_reconnects_;
  uint64_t probe = 0;  // the first batch sent serving_proof after `began`: its ack is the proof
  while (generation_ == generation) {
    const absl::Time now = absl::Now();
    if (now >= deadline || (cancel != nullptr && cancel->cancelled()) || client_closed_) {
      return SessionWait::kGaveUp;
    }
    if (failed_reconnects_ != failed_before && absl::IsPermissionDenied(reconnect_error_)) {
      return SessionWait::kRefused;
    }
    if (probe != 0 && connected_ && acked_sequence_ >= probe &&
        (fast_ == nullptr || fast_->DaemonServing())) {
      return SessionWait::kServing;
    }
    if (probe == 0 && connected_ && now - began >= serving_proof) probe = next_sequence_;
    // A live stream is probed with an empty batch (the daemon may be stopping without having
    // hung up yet); a broken one is reconnected now rather than after the backoff.
    if (connected_) flush_requested_ = true;
    work_.Signal();
    session_opened_.WaitWithTimeout(&mu_, std::min(kSessionPoll, deadline - now));
  }
  return SessionWait::kNewSession;
}

absl::Status ClientCore::NoSession(std::string_view what) const {
  MutexLock lock(&mu_);
  if (absl::IsPermissionDenied(reconnect_error_)) {
    return absl::PermissionDeniedError(absl::StrCat(
        absl::string_view(what.data(), what.size()), ": the session with tensorshmd at unix:",
        socket_, " ended, and a new one was refused: ", reconnect_error_.message()));
  }
  return absl::UnavailableError(absl::StrCat(
      absl::string_view(what.data(), what.size()), ": the session with tensorshmd at unix:",
      socket_, " ended and no new one opened before the call's deadline (is the daemon running?)",
      reconnect_error_.ok() ? ""
                            : absl::StrCat(" (last attempt: ", reconnect_error_.message(), ")")));
}

std::string ClientCore::session_id() const {
  MutexLock lock(&mu_);
  return session_id_;
}

uint64_t ClientCore::session_number() const {
  MutexLock lock(&mu_);
  return session_number_;
}

uint64_t ClientCore::daemon_instance() const {
  MutexLock lock(&mu_);
  return daemon_instance_;
}

absl::Status ClientCore::CheckProcess() const {
  if (!forked()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this tensorshm client was connected in process ", pid_, "; process ", getpid(),
      " is a fork of it and may not use its connection, session or leases: connect again in "
      "this process"));
}

uint64_t ClientCore::AddLease(uint64_t tensor_id, uint64_t lease_id) {
  MutexLock lock(&mu_);
  return holdings_.AddLease(tensor_id, lease_id);
}

uint64_t ClientCore::AddUnpublished(uint64_t tensor_id) {
  MutexLock lock(&mu_);
  return holdings_.AddUnpublished(tensor_id);
}

absl::StatusOr<uint64_t> ClientCore::UnpublishedId(uint64_t key) const {
  MutexLock lock(&mu_);
  std::optional<uint64_t> id = holdings_.UnpublishedId(key);
  if (!id.has_value()) {
    return absl::DataLossError(
        absl::StrCat("this writable tensor was lost when tensorshmd at unix:", socket_,
                     " restarted (not taken back in its --recovery-grace); create it again"));
  }
  return *id;
}

void ClientCore::Published(uint64_t key) {
  MutexLock lock(&mu_);
  holdings_.Published(key);
  // Nothing to send: only a closed client's sender waits for this (a wake-up per publish would
  // cost a context switch on the hot path).
  if (client_closed_) work_.Signal();
}

absl::Status ClientCore::LeaseStatus(uint64_t key) const {
  MutexLock lock(&mu_);
  const Holdings::Lease* lease = holdings_.FindLease(key);
  if (lease != nullptr && lease->lease_id != 0) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      lease == nullptr ? std::string("this tensor") : absl::StrCat("tensor ", lease->tensor_id),
      ": tensorshmd at unix:", socket_,
      " restarted and did not take its lease back; the memory is no longer reserved for it"));
}

void ClientCore::QueueRelease(uint64_t key) noexcept {
  MutexLock lock(&mu_);
  holdings_.QueueRelease(key);
  work_.Signal();
}

void ClientCore::QueueAbandon(uint64_t key) noexcept {
  MutexLock lock(&mu_);
  holdings_.QueueAbandon(key);
  work_.Signal();
}

}  // namespace tensorshm
