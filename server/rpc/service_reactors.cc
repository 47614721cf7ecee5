// The calls that outlive their handler: Session streams, and Acquires that wait for a publish.
// Neither holds a thread while it waits (gRPC's callback API); both are finished with mu_
// released, since gRPC may run a reactor's OnCancel and OnDone inline.
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "common/tensor/grpc_status.h"
#include "common/tensor/name.h"
#include "server/ops/log.h"
#include "server/rpc/service.h"

namespace tensorshm {

// One client's Session stream: reads a request, answers it, reads the next (each request has
// exactly one response, so one read or one write is outstanding at a time, never both). When
// the stream ends (the client closed it, exited or died, or the daemon is stopping) the session
// is closed and the reactor finishes; it deletes itself in OnDone.
class TensorShmService::SessionReactor final
    : public grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse> {
 public:
  SessionReactor(TensorShmService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    absl::StatusOr<PeerCredentials> peer = service_->Admit(*context);
    if (!peer.ok()) {
      service_->metrics_.CountOp(MetricOp::kSessionOpen, peer.status());
      Finish(ToGrpcStatus(peer.status()));
      return;
    }
    peer_ = *peer;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      End(grpc::Status::OK);  // closed by the client, or cancelled
      return;
    }
    if (!opened_) {
      if (!request_.has_open()) {
        service_->metrics_.CountOp(MetricOp::kSessionOpen, absl::StatusCode::kInvalidArgument);
        End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         "Session: the first message must be `open`"));
        return;
      }
      absl::StatusOr<v1::SessionResponse> opened =
          service_->OpenSession(*context_, peer_, request_.open(), &session_id_, &token_);
      service_->metrics_.CountOp(MetricOp::kSessionOpen, opened.status());
      if (!opened.ok()) {
        End(ToGrpcStatus(opened.status()));
        return;
      }
      opened_ = true;
      response_ = *std::move(opened);
    } else {
      if (!request_.has_release()) {
        service_->metrics_.CountOp(MetricOp::kRelease, absl::StatusCode::kInvalidArgument);
        End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         "Session: after `open`, only `release` messages are accepted"));
        return;
      }
      std::optional<v1::SessionResponse> ack = service_->SessionRelease(token_, request_.release());
      service_->metrics_.CountOp(MetricOp::kRelease, ack.has_value()
                                                         ? absl::StatusCode::kOk
                                                         : absl::StatusCode::kFailedPrecondition);
      if (!ack.has_value()) {
        End(grpc::Status::OK);
        return;
      }
      response_ = *std::move(ack);
    }
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(grpc::Status::OK);
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  void End(const grpc::Status& status) {
    if (opened_) service_->CloseSession(session_id_, token_);
    Finish(status);
  }

  TensorShmService* const service_;
  grpc::CallbackServerContext* const context_;
  PeerCredentials peer_;
  v1::SessionRequest request_;
  v1::SessionResponse response_;
  bool opened_ = false;
  uint64_t session_id_ = 0;
  std::string token_;
};

// An Acquire: answered at once when it can be, else kept in the service's acquires_waiting_
// until one of a publish of its name, its deadline, its cancellation, its session's end or
// shutdown takes it off (under mu_, so exactly one does) and finishes it. Deletes itself in
// OnDone.
class TensorShmService::Waiter final : public grpc::ServerUnaryReactor {
 public:
  Waiter(TensorShmService* service, grpc::CallbackServerContext* context,
         const v1::AcquireRequest& request, v1::AcquireResponse* response)
      : service(service),
        context(context),
        name(request.name()),
        wait_ms(request.wait_ms()),
        request_id(request.request_id()),
        response(response) {}

  void OnCancel() override { service->CancelWaiter(this); }
  void OnDone() override {
    service->WaiterDone(this, context->IsCancelled());
    delete this;
  }

  // The DEADLINE_EXCEEDED answer, as a waiter polling its deadline gave it.
  grpc::Status Expired() const {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        absl::StrCat("name = \"", name, "\": not published within ",
                                     wait_ms > 0 ? absl::StrCat("wait_ms = ", wait_ms)
                                                 : std::string("the call's deadline")));
  }

  TensorShmService* const service;
  grpc::CallbackServerContext* const context;
  const std::string name;
  const int64_t wait_ms;
  const uint64_t request_id;            // AcquireRequest.request_id: 0 if none
  v1::AcquireResponse* const response;  // gRPC's, until the call is finished
  absl::Time deadline = absl::InfiniteFuture();
  absl::Time waiting_since;  // when it was listed (tensorshm_acquire_wait_seconds)
  // Counted against --uid-waiters while listed (UidLimits has its own lock).
  std::optional<UidLimits::WaitCharge> wait_charge;

  // Under the service's mu_ (set by AddWaiter, and Grant).
  uint64_t session_id = 0;
  std::string token;
  uint64_t lease_id = 0;  // the lease granted in `response`, if any
};

grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* TensorShmService::Session(
    grpc::CallbackServerContext* context) {
  return new SessionReactor(this, context);
}

grpc::ServerUnaryReactor* TensorShmService::Acquire(grpc::CallbackServerContext* context,
                                                    const v1::AcquireRequest* request,
                                                    v1::AcquireResponse* response) {
  // Finished or not, the waiter lives until gRPC calls its OnDone, which it does only after
  // this returns.
  return StartWaiter(new Waiter(this, context, *request, response), context);
}

grpc::ServerUnaryReactor* TensorShmService::StartWaiter(Waiter* waiter,
                                                        grpc::CallbackServerContext* context) {
  // gRPC reports "no deadline" as a far-future time point that absl cannot represent exactly.
  const auto grpc_deadline = context->deadline();
  const absl::Time call_deadline =
      grpc_deadline >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365)
          ? absl::InfiniteFuture()
          : absl::FromChrono(grpc_deadline);
  waiter->deadline =
      waiter->wait_ms > 0
          ? std::min(call_deadline, absl::Now() + absl::Milliseconds(waiter->wait_ms))
          : call_deadline;
  const UnaryFrame frame{.op = MetricOp::kAcquire,
                         .reactor = waiter,
                         .request_id = waiter->request_id,
                         .checked = ValidateName(waiter->name)};
  return Unary(context, frame, [&](UnaryCall& call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    tensorshm::Session& session = *call.session;
    if (session.TakeSettled(waiter->request_id)) {
      return absl::CancelledError("acquire settled (cancelled) by the client before it arrived");
    }
    if (const Tensor* tensor = catalog_->Find(waiter->name); tensor != nullptr) {
      // A tensor whose record another process overwrote is DATA_LOSS, not served.
      if (absl::Status s = catalog_->Verify(tensor->id); !s.ok()) return s;
      if (absl::Status s = session.uid_charge.AddLeases(); !s.ok()) return s;
      Grant(session, *tensor, waiter->response);
      waiter->token = session.token;
      waiter->lease_id = waiter->response->lease_id();
      session.RecordGrant(waiter->request_id, {waiter->lease_id, {}});
      return absl::OkStatus();
    }
    if (waiter->wait_ms == 0) {
      return absl::NotFoundError(absl::StrCat("name = \"", waiter->name, "\": not published"));
    }
    if (shutting_down_) return absl::UnavailableError("tensorshmd is stopping");
    if (context->IsCancelled()) return absl::CancelledError("acquire cancelled by the client");
    if (absl::Now() >= waiter->deadline) return FromGrpcStatus(waiter->Expired());
    if (absl::Status s = AddWaiter(waiter, session); !s.ok()) return s;
    call.answered_later = true;  // listed: whoever takes it off the lists finishes it
    return absl::OkStatus();
  });
}

absl::Status TensorShmService::AddWaiter(Waiter* waiter, const tensorshm::Session& session) {
  absl::StatusOr<UidLimits::WaitCharge> charge = uid_limits_.StartWait(session.uid);
  if (!charge.ok()) return charge.status();
  waiter->wait_charge = *std::move(charge);
  waiter->session_id = session.id;
  waiter->token = session.token;
  // The timer sleeps until the earliest deadline: wake it if this one is earlier.
  if (acquires_waiting_.Add(waiter, waiter->name, session.id, waiter->deadline)) {
    next_deadline_.Signal();
  }
  waiter->waiting_since = absl::Now();
  metrics_.WaitStarted();
  return absl::OkStatus();
}

void TensorShmService::RemoveWaiter(Waiter* waiter) {
  acquires_waiting_.Remove(waiter);
  waiter->wait_charge.reset();
  metrics_.WaitEnded();
}

void TensorShmService::FinishLater(Waiter* waiter, grpc::Status status) {
  TSM_CHECK(!acquires_waiting_.Contains(waiter));
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  metrics_.CountOp(MetricOp::kAcquire, code);
  metrics_.ObserveAcquireWait(absl::Now() - waiter->waiting_since, code);
  const bool granted = status.ok() && waiter->request_id != 0;
  finishing_.push_back({waiter, std::move(status), granted});
}

void TensorShmService::UnlockAndFinish() {
  // Memory freed (or a waiting create gone) under this lock: the waiting creates try again.
  if (!creates_waiting_.empty() &&
      (retry_creates_ || catalog_->release_epoch() != retried_epoch_)) {
    RetryWaitingCreates();
  }
  std::vector<Finishing> finishing;
  finishing.swap(finishing_);
  mu_.unlock();
  for (Finishing& f : finishing) FinishGranting(f.reactor, std::move(f.status), f.granted);
}

void TensorShmService::WakeWaiters(const std::string& name) {
  const std::vector<Waiter*> woken = acquires_waiting_.WithKey(name);
  if (woken.empty()) return;
  const Tensor* tensor = catalog_->Find(name);
  TSM_CHECK(tensor != nullptr);
  for (Waiter* waiter : woken) {
    RemoveWaiter(waiter);
    // A waiter's session is alive: CloseSession takes its waiters off first.
    tensorshm::Session* session = sessions_.Find(waiter->token);
    TSM_CHECK(session != nullptr);
    absl::Status refused = catalog_->Verify(tensor->id);
    if (refused.ok()) refused = session->uid_charge.AddLeases();
    if (!refused.ok()) {
      FinishLater(waiter, ToGrpcStatus(refused));
      continue;
    }
    Grant(*session, *tensor, waiter->response);
    waiter->lease_id = waiter->response->lease_id();
    session->RecordGrant(waiter->request_id, {waiter->lease_id, {}});
    FinishLater(waiter, grpc::Status::OK);
  }
}

void TensorShmService::FailSessionWaiters(uint64_t session_id, const std::string& token) {
  const std::vector<Waiter*> failed = acquires_waiting_.OfSession(session_id);
  if (failed.empty()) return;
  const grpc::Status status = ToGrpcStatus(NoSession(token));
  for (Waiter* waiter : failed) {
    RemoveWaiter(waiter);
    FinishLater(waiter, status);
  }
}

void TensorShmService::SettleRequest(tensorshm::Session& session, uint64_t request_id) {
  if (request_id == 0) return;
  // Granted: given back (whatever of it the client cannot know it holds).
  if (auto it = session.granted_requests.find(request_id); it != session.granted_requests.end()) {
    GiveBack(session, it->second);
    session.granted_requests.erase(it);
    return;
  }
  // Waiting (the client gave up before the daemon heard of it): ends now, with nothing granted.
  for (Waiter* waiter : acquires_waiting_.OfSession(session.id)) {
    if (waiter->request_id != request_id) continue;
    RemoveWaiter(waiter);
    FinishLater(waiter, grpc::Status(grpc::StatusCode::CANCELLED,
                                     "acquire settled (cancelled) by the client"));
    return;
  }
  if (CancelSettledCreate(session.id, request_id)) return;
  // Not arrived yet, answered without a grant, or being made (GrowPools): KeepCreated and the
  // calls' arrival look here.
  session.NoteSettled(request_id);
}

void TensorShmService::CancelWaiter(Waiter* waiter) {
  ServiceLock lock(this);
  // Finished already, or being finished.
  if (!acquires_waiting_.Contains(waiter)) return;
  RemoveWaiter(waiter);
  FinishLater(waiter, grpc::Status(grpc::StatusCode::CANCELLED, "acquire cancelled by the client"));
}

void TensorShmService::WaiterDone(Waiter* waiter, bool cancelled) {
  ServiceLock lock(this);
  TSM_CHECK(!acquires_waiting_.Contains(waiter));
  if (!cancelled || waiter->lease_id == 0) return;
  // The test hook plays an answer that crossed the cancel: only the client's settle gives back.
  if (waiter->request_id != 0 && cross_cancel_hold_ > absl::ZeroDuration()) return;
  // Granted, but the client gave up on the call before the answer reached it: nobody knows the
  // lease's id, so nobody would release it before its session ends.
  tensorshm::Session* session = sessions_.Find(waiter->token);
  if (session == nullptr) return;  // ended: its leases went with it
  auto lease = session->leases.find(waiter->lease_id);
  if (lease == session->leases.end()) return;
  catalog_->DropLease(lease->second);
  session->leases.erase(lease);
  session->uid_charge.DropLeases();
}

void TensorShmService::BeginShutdown() {
  ServiceLock lock(this);
  shutting_down_ = true;
  catalog_->mutable_index().StopServing();
  const grpc::Status stopping(grpc::StatusCode::UNAVAILABLE, "tensorshmd is stopping");
  for (Waiter* waiter : acquires_waiting_.All()) {
    RemoveWaiter(waiter);
    FinishLater(waiter, stopping);
  }
  FailWaitingCreates(stopping);
  stopping_.SignalAll();
  next_deadline_.SignalAll();
  creates_pending_.SignalAll();
}

void TensorShmService::ExpireWaiters() {
  while (true) {
    ServiceLock lock(this);
    if (shutting_down_) return;
    const absl::Time now = absl::Now();
    bool expired = false;
    while (Waiter* waiter = acquires_waiting_.Expired(now)) {
      RemoveWaiter(waiter);
      FinishLater(waiter, waiter->Expired());
      expired = true;
    }
    if (ExpireCreates(now)) expired = true;
    if (expired) continue;  // finished as `lock` goes, then the queue is looked at again
    const absl::Time next =
        std::min(creates_waiting_.NextDeadline(), acquires_waiting_.NextDeadline());
    if (next == absl::InfiniteFuture()) {
      next_deadline_.Wait(&mu_);
    } else {
      next_deadline_.WaitWithTimeout(&mu_, next - now);
    }
  }
}

}  // namespace tensorshm
