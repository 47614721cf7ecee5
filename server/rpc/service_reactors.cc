// The calls that outlive their handler: Session streams, Acquires that wait for a publish and
// creates that wait for memory. None holds a thread while it waits (gRPC's callback API); the
// Store answers the waiting ones (PendingCall::Answer) with its lock released, since gRPC may run
// a reactor's OnCancel and OnDone inline.
#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/time/clock.h"
#include "common/tensor/grpc_status.h"
#include "server/rpc/service.h"
#include "server/rpc/wire_calls.h"
#include "server/rpc/wire_results.h"

namespace tensorshm {
namespace {

// The call's deadline; gRPC reports "no deadline" as a far-future time point that absl cannot
// represent exactly.
absl::Time CallDeadline(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  return deadline >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365)
             ? absl::InfiniteFuture()
             : absl::FromChrono(deadline);
}

}  // namespace

// One client's Session stream: reads a request, answers it, reads the next (each request has
// exactly one response, so one read or one write is outstanding at a time, never both). When
// the stream ends (the client closed it, exited or died, or the daemon is stopping) the session
// is closed and the reactor finishes; it deletes itself in OnDone.
class TensorShmService::SessionReactor final
    : public grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse> {
 public:
  SessionReactor(TensorShmService* service, grpc::CallbackServerContext* context)
      : store_(service->store_), context_(context) {
    absl::StatusOr<PeerCredentials> peer = service->Admit(*context);
    if (!peer.ok()) {
      store_.metrics().CountOp(MetricOp::kSessionOpen, peer.status());
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
        store_.metrics().CountOp(MetricOp::kSessionOpen, absl::StatusCode::kInvalidArgument);
        End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         "Session: the first message must be `open`"));
        return;
      }
      absl::StatusOr<OpenedSession> opened =
          store_.OpenSession(peer_, context_->peer(), FromWire(request_.open()));
      store_.metrics().CountOp(MetricOp::kSessionOpen, opened.status());
      if (!opened.ok()) {
        End(ToGrpcStatus(opened.status()));
        return;
      }
      opened_ = true;
      session_id_ = opened->session_number;
      token_ = opened->token;
      response_.Clear();
      ToWire(*opened, response_.mutable_opened());
    } else {
      if (!request_.has_release()) {
        store_.metrics().CountOp(MetricOp::kRelease, absl::StatusCode::kInvalidArgument);
        End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         "Session: after `open`, only `release` messages are accepted"));
        return;
      }
      std::optional<ReleasesDone> done =
          store_.SessionRelease(token_, FromWire(request_.release()));
      store_.metrics().CountOp(MetricOp::kRelease, done.has_value()
                                                       ? absl::StatusCode::kOk
                                                       : absl::StatusCode::kFailedPrecondition);
      if (!done.has_value()) {
        End(grpc::Status::OK);
        return;
      }
      response_.Clear();
      ToWire(*done, response_.mutable_ack());
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
    if (opened_) store_.CloseSession(session_id_, token_);
    Finish(status);
  }

  Store& store_;
  grpc::CallbackServerContext* const context_;
  PeerCredentials peer_;
  v1::SessionRequest request_;
  v1::SessionResponse response_;
  bool opened_ = false;
  uint64_t session_id_ = 0;
  std::string token_;
};

// An Acquire as a reactor: the Store answers it at once or keeps it among its waiters
// (AcquireWait) until one publish, deadline, cancellation, session end or shutdown answers it.
// Deletes itself in OnDone.
class TensorShmService::Waiter final : public grpc::ServerUnaryReactor, public AcquireWait {
 public:
  Waiter(TensorShmService* service, grpc::CallbackServerContext* context,
         const v1::AcquireRequest& request, v1::AcquireResponse* response)
      : AcquireWait(FromWire(request)), service_(service), context_(context), response_(response) {}

  void Answer(absl::Status status, bool carries_grant) override {
    if (status.ok()) ToWire(granted, response_);
    service_->FinishGranting(this, ToGrpcStatus(status), carries_grant);
  }
  bool Cancelled() const override { return context_->IsCancelled(); }
  void OnCancel() override { service_->store_.CancelWaiter(this); }
  void OnDone() override {
    service_->store_.WaiterDone(this, context_->IsCancelled());
    delete this;
  }

 private:
  TensorShmService* const service_;
  grpc::CallbackServerContext* const context_;
  v1::AcquireResponse* const response_;
};

// A create with wait_ms != 0 as a reactor: the Store answers it at once or once it is served
// (CreateWait). Deletes itself in OnDone.
class TensorShmService::CreateWaiter final : public grpc::ServerUnaryReactor, public CreateWait {
 public:
  CreateWaiter(TensorShmService* service, grpc::CallbackServerContext* context, CreateOrder order,
               v1::CreateResponse* response)
      : CreateWait(std::move(order)), service_(service), context_(context), response_(response) {}

  void Answer(absl::Status status, bool granted) override {
    if (status.ok()) ToWire(created, response_);
    service_->FinishGranting(this, ToGrpcStatus(status), granted);
  }
  bool Cancelled() const override { return context_->IsCancelled(); }
  void OnCancel() override { service_->store_.CancelCreate(this); }
  void OnDone() override {
    service_->store_.CreateWaiterDone(this, context_->IsCancelled());
    delete this;
  }

 private:
  TensorShmService* const service_;
  grpc::CallbackServerContext* const context_;
  v1::CreateResponse* const response_;
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
  auto* waiter = new Waiter(this, context, *request, response);
  const absl::Time call_deadline = CallDeadline(*context);
  waiter->deadline =
      waiter->wait_ms > 0
          ? std::min(call_deadline, absl::Now() + absl::Milliseconds(waiter->wait_ms))
          : call_deadline;
  const UnaryFrame frame{
      .op = MetricOp::kAcquire, .reactor = waiter, .request_id = waiter->request_id};
  return Unary(context, frame, [&](const PeerCredentials& peer, bool* answered_later) {
    const absl::Status status =
        store_.Acquire(peer, SessionToken(*context), waiter, answered_later);
    if (status.ok() && !*answered_later) ToWire(waiter->granted, response);
    return status;
  });
}

grpc::ServerUnaryReactor* TensorShmService::CreateWaiting(grpc::CallbackServerContext* context,
                                                          const v1::CreateRequest* request,
                                                          v1::CreateResponse* response) {
  absl::StatusOr<CreateOrder> order = FromWire(*request);
  if (!order.ok()) {
    return Unary(context, {.op = MetricOp::kCreate},
                 [&](const PeerCredentials&, bool*) { return order.status(); });
  }
  // Finished or not, the waiter lives until gRPC calls its OnDone, which it does only after
  // this returns.
  auto* waiter = new CreateWaiter(this, context, *std::move(order), response);
  const absl::Time call_deadline = CallDeadline(*context);
  const int64_t wait_ms = waiter->order.wait_ms;
  waiter->deadline = wait_ms > 0
                         ? std::min(call_deadline, waiter->started + absl::Milliseconds(wait_ms))
                         : call_deadline;
  const UnaryFrame frame{
      .op = MetricOp::kCreate, .reactor = waiter, .request_id = waiter->order.request_id};
  return Unary(context, frame, [&](const PeerCredentials& peer, bool* answered_later) {
    const absl::Status status =
        store_.CreateWaiting(peer, SessionToken(*context), waiter, answered_later);
    if (status.ok() && !*answered_later) ToWire(waiter->created, response);
    return status;
  });
}

}  // namespace tensorshm
