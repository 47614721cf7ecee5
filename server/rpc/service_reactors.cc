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

// An Acquire: answered at once when it can be, else kept on the service's waiter lists until
// one of a publish of its name, its deadline, its cancellation, its session's end or shutdown
// takes it off them (under mu_, so exactly one does) and finishes it. Deletes itself in OnDone.
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
  bool listed = false;  // on the lists: not finished yet
  uint64_t session_id = 0;
  std::string token;
  uint64_t lease_id = 0;  // the lease granted in `response`, if any
  WaiterList::iterator by_name;
  WaiterList::iterator by_session;
  std::multimap<absl::Time, Waiter*>::iterator by_deadline;  // if deadline is finite
};

grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* TensorShmService::Session(
    grpc::CallbackServerContext* context) {
  return new SessionReactor(this, context);
}

grpc::ServerUnaryReactor* TensorShmService::Acquire(grpc::CallbackServerContext* context,
                                                    const v1::AcquireRequest* request,
                                                    v1::AcquireResponse* response) {
  auto* waiter = new Waiter(this, context, *request, response);
  StartWaiter(waiter, context);
  // Finished or not, the waiter lives until gRPC calls its OnDone, which it does only after
  // this returns.
  return waiter;
}

void TensorShmService::StartWaiter(Waiter* waiter, grpc::CallbackServerContext* context) {
  grpc::Status status;
  [&] {
    absl::StatusOr<PeerCredentials> peer = Admit(*context);
    if (!peer.ok()) {
      status = ToGrpcStatus(peer.status());
      return;
    }
    if (absl::Status s = ValidateName(waiter->name); !s.ok()) {
      status = ToGrpcStatus(s);
      return;
    }
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
    ServiceLock lock(this);
    absl::StatusOr<tensorshm::Session*> session = CallerSession(*context, *peer);
    if (!session.ok()) {
      status = ToGrpcStatus(session.status());
      return;
    }
    if ((*session)->TakeSettled(waiter->request_id)) {
      status = grpc::Status(grpc::StatusCode::CANCELLED,
                            "acquire settled (cancelled) by the client before it arrived");
      return;
    }
    if (const Tensor* tensor = catalog_->Find(waiter->name); tensor != nullptr) {
      // A tensor whose record another process overwrote is DATA_LOSS, not served.
      if (absl::Status s = catalog_->Verify(tensor->id); !s.ok()) {
        status = ToGrpcStatus(s);
        return;
      }
      if (absl::Status s = (*session)->uid_charge.AddLeases(); !s.ok()) {
        status = ToGrpcStatus(s);
        return;
      }
      Grant(**session, *tensor, waiter->response);
      waiter->token = (*session)->token;
      waiter->lease_id = waiter->response->lease_id();
      (*session)->RecordGrant(waiter->request_id, {waiter->lease_id, {}});
      status = grpc::Status::OK;
      return;
    }
    if (waiter->wait_ms == 0) {
      status = grpc::Status(grpc::StatusCode::NOT_FOUND,
                            absl::StrCat("name = \"", waiter->name, "\": not published"));
      return;
    }
    if (shutting_down_) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "tensorshmd is stopping");
      return;
    }
    if (context->IsCancelled()) {
      status = grpc::Status(grpc::StatusCode::CANCELLED, "acquire cancelled by the client");
      return;
    }
    if (absl::Now() >= waiter->deadline) {
      status = waiter->Expired();
      return;
    }
    if (absl::Status s = AddWaiter(waiter, **session); !s.ok()) {
      status = ToGrpcStatus(s);
      return;
    }
    waiter = nullptr;  // listed: whoever takes it off the lists finishes it
  }();
  if (waiter != nullptr) {
    metrics_.CountOp(MetricOp::kAcquire, static_cast<absl::StatusCode>(status.error_code()));
    FinishGranting(waiter, status, waiter->lease_id != 0 && waiter->request_id != 0);
  }
}

absl::Status TensorShmService::AddWaiter(Waiter* waiter, const tensorshm::Session& session) {
  absl::StatusOr<UidLimits::WaitCharge> charge = uid_limits_.StartWait(session.uid);
  if (!charge.ok()) return charge.status();
  waiter->wait_charge = *std::move(charge);
  waiter->session_id = session.id;
  waiter->token = session.token;
  WaiterList& by_name = waiters_by_name_[waiter->name];
  waiter->by_name = by_name.insert(by_name.end(), waiter);
  WaiterList& by_session = waiters_by_session_[session.id];
  waiter->by_session = by_session.insert(by_session.end(), waiter);
  if (waiter->deadline != absl::InfiniteFuture()) {
    waiter->by_deadline = waiters_by_deadline_.emplace(waiter->deadline, waiter);
    // The timer sleeps until the earliest deadline: wake it if this one is earlier.
    if (waiter->by_deadline == waiters_by_deadline_.begin()) next_deadline_.Signal();
  }
  waiter->listed = true;
  waiter->waiting_since = absl::Now();
  metrics_.WaitStarted();
  return absl::OkStatus();
}

void TensorShmService::RemoveWaiter(Waiter* waiter) {
  TSM_CHECK(waiter->listed);
  waiter->listed = false;
  waiter->wait_charge.reset();
  metrics_.WaitEnded();
  auto name = waiters_by_name_.find(waiter->name);
  name->second.erase(waiter->by_name);
  if (name->second.empty()) waiters_by_name_.erase(name);
  auto session = waiters_by_session_.find(waiter->session_id);
  session->second.erase(waiter->by_session);
  if (session->second.empty()) waiters_by_session_.erase(session);
  if (waiter->deadline != absl::InfiniteFuture()) waiters_by_deadline_.erase(waiter->by_deadline);
}

void TensorShmService::FinishLater(Waiter* waiter, grpc::Status status) {
  TSM_CHECK(!waiter->listed);
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
  auto it = waiters_by_name_.find(name);
  if (it == waiters_by_name_.end()) return;
  const Tensor* tensor = catalog_->Find(name);
  TSM_CHECK(tensor != nullptr);
  const std::vector<Waiter*> woken(it->second.begin(), it->second.end());
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
  auto it = waiters_by_session_.find(session_id);
  if (it == waiters_by_session_.end()) return;
  const grpc::Status status = ToGrpcStatus(NoSession(token));
  const std::vector<Waiter*> failed(it->second.begin(), it->second.end());
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
  if (auto it = waiters_by_session_.find(session.id); it != waiters_by_session_.end()) {
    for (Waiter* waiter : it->second) {
      if (waiter->request_id != request_id) continue;
      RemoveWaiter(waiter);
      FinishLater(waiter, grpc::Status(grpc::StatusCode::CANCELLED,
                                       "acquire settled (cancelled) by the client"));
      return;
    }
  }
  if (CancelSettledCreate(session.id, request_id)) return;
  // Not arrived yet, answered without a grant, or being made (GrowPools): KeepCreated and the
  // calls' arrival look here.
  session.NoteSettled(request_id);
}

void TensorShmService::CancelWaiter(Waiter* waiter) {
  ServiceLock lock(this);
  if (!waiter->listed) return;  // finished already, or being finished
  RemoveWaiter(waiter);
  FinishLater(waiter, grpc::Status(grpc::StatusCode::CANCELLED, "acquire cancelled by the client"));
}

void TensorShmService::WaiterDone(Waiter* waiter, bool cancelled) {
  ServiceLock lock(this);
  TSM_CHECK(!waiter->listed);
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
  std::vector<Waiter*> all;
  for (const auto& [session_id, waiters] : waiters_by_session_) {
    all.insert(all.end(), waiters.begin(), waiters.end());
  }
  const grpc::Status stopping(grpc::StatusCode::UNAVAILABLE, "tensorshmd is stopping");
  for (Waiter* waiter : all) {
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
    while (!waiters_by_deadline_.empty() && waiters_by_deadline_.begin()->first <= now) {
      Waiter* waiter = waiters_by_deadline_.begin()->second;
      RemoveWaiter(waiter);
      FinishLater(waiter, waiter->Expired());
      expired = true;
    }
    if (ExpireCreates(now)) expired = true;
    if (expired) continue;  // finished as `lock` goes, then the queue is looked at again
    absl::Time next = NextCreateDeadline();
    if (!waiters_by_deadline_.empty()) next = std::min(next, waiters_by_deadline_.begin()->first);
    if (next == absl::InfiniteFuture()) {
      next_deadline_.Wait(&mu_);
    } else {
      next_deadline_.WaitWithTimeout(&mu_, next - now);
    }
  }
}

}  // namespace tensorshm
