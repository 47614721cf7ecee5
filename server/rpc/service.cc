// The gRPC service's frame (Unary, Admit, the session the call names) and its unary calls, each
// a translation to the Store's operation of the same name. Session streams and the calls that
// wait are in service_reactors.cc; the memory channel's requests reach the Store through
// channel_handler.cc.
#include "server/rpc/service.h"

#include <memory>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "common/tensor/grpc_status.h"
#include "server/rpc/wire_calls.h"
#include "server/rpc/wire_results.h"

namespace tensorshm {

// A create on the call's default reactor: answered at once by the handler, or by GrowPools once
// the pool has grown (then it answers the call, and goes).
class TensorShmService::LaterAnswer final : public CreateCall {
 public:
  LaterAnswer(TensorShmService* service, grpc::ServerUnaryReactor* reactor, CreateOrder order,
              v1::CreateResponse* response)
      : CreateCall(std::move(order)), service_(service), reactor_(reactor), response_(response) {}
  void Answer(absl::Status status, bool granted) override {
    if (status.ok()) ToWire(created, response_);
    service_->FinishGranting(reactor_, ToGrpcStatus(status), granted);
    delete this;
  }

 private:
  TensorShmService* const service_;
  grpc::ServerUnaryReactor* const reactor_;
  v1::CreateResponse* const response_;
};

TensorShmService::TensorShmService(Store& store, absl::Duration cross_cancel_hold)
    : store_(store), cross_cancel_hold_(cross_cancel_hold) {}

TensorShmService::~TensorShmService() = default;

void TensorShmService::FinishGranting(grpc::ServerUnaryReactor* reactor, grpc::Status status,
                                      bool granted) {
  const absl::Duration hold = cross_cancel_hold_;
  if (!granted || hold == absl::ZeroDuration() || !status.ok()) {
    reactor->Finish(std::move(status));
    return;
  }
  // Test only: the answer leaves later, on a thread of its own. gRPC's shutdown waits for it
  // (the call is not done until it is finished).
  std::thread([reactor, status = std::move(status), hold]() mutable {
    absl::SleepFor(hold);
    reactor->Finish(std::move(status));
  }).detach();
}

grpc::ServerUnaryReactor* TensorShmService::Unary(
    grpc::CallbackServerContext* context, const UnaryFrame& frame,
    absl::FunctionRef<absl::Status(const PeerCredentials& peer, bool* answered_later)> body) {
  grpc::ServerUnaryReactor* reactor =
      frame.reactor != nullptr ? frame.reactor : context->DefaultReactor();
  bool answered_later = false;
  const absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<PeerCredentials> peer = Admit(*context);
    if (!peer.ok()) return peer.status();
    return body(*peer, &answered_later);
  }();
  if (answered_later) return reactor;
  if (frame.counted) store_.metrics().CountOp(frame.op, status);
  FinishGranting(reactor, ToGrpcStatus(status), status.ok() && frame.request_id != 0);
  return reactor;
}

absl::StatusOr<PeerCredentials> TensorShmService::Admit(
    const grpc::ServerContextBase& context) const {
  return store_.Admit(context.peer());
}

std::optional<std::string> TensorShmService::SessionToken(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kSessionMetadataKey);
  if (it == metadata.end()) return std::nullopt;
  return std::string(it->second.data(), it->second.size());
}

grpc::ServerUnaryReactor* TensorShmService::Create(grpc::CallbackServerContext* context,
                                                   const v1::CreateRequest* request,
                                                   v1::CreateResponse* response) {
  if (request->wait_ms() != 0) return CreateWaiting(context, request, response);
  // Once only: each DefaultReactor() call makes the reactor anew.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const UnaryFrame frame{
      .op = MetricOp::kCreate, .reactor = reactor, .request_id = request->request_id()};
  return Unary(context, frame, [&](const PeerCredentials& peer, bool* answered_later) {
    absl::StatusOr<CreateOrder> order = FromWire(*request);
    if (!order.ok()) return order.status();
    auto call = std::make_unique<LaterAnswer>(this, reactor, *std::move(order), response);
    const absl::Status status =
        store_.Create(peer, SessionToken(*context), call.get(), answered_later);
    if (*answered_later) {
      call.release();  // a create whose pool must grow first: GrowPools answers it
    } else if (status.ok()) {
      ToWire(call->created, response);
    }
    return status;
  });
}

grpc::ServerUnaryReactor* TensorShmService::Publish(grpc::CallbackServerContext* context,
                                                    const v1::PublishRequest* request,
                                                    v1::PublishResponse* response) {
  return Unary(context, {.op = MetricOp::kPublish}, [&](const PeerCredentials& peer, bool*) {
    absl::StatusOr<PublishOrder> order = FromWire(*request);
    if (!order.ok()) return order.status();
    absl::StatusOr<Published> published = store_.Publish(peer, SessionToken(*context), *order);
    if (!published.ok()) return published.status();
    ToWire(*published, response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* TensorShmService::Delete(grpc::CallbackServerContext* context,
                                                   const v1::DeleteRequest* request,
                                                   v1::DeleteResponse*) {
  return Unary(context, {.op = MetricOp::kDelete}, [&](const PeerCredentials& peer, bool*) {
    return store_.Delete(peer, SessionToken(*context), request->name());
  });
}

grpc::ServerUnaryReactor* TensorShmService::List(grpc::CallbackServerContext* context,
                                                 const v1::ListRequest* request,
                                                 v1::ListResponse* response) {
  return Unary(context, {.op = MetricOp::kList}, [&](const PeerCredentials& peer, bool*) {
    absl::StatusOr<std::vector<TensorListing>> listed = store_.List(peer, request->prefix());
    if (!listed.ok()) return listed.status();
    ToWire(*listed, response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* TensorShmService::Stat(grpc::CallbackServerContext* context,
                                                 const v1::StatRequest*,
                                                 v1::StatResponse* response) {
  return Unary(context, {.op = MetricOp::kStat}, [&](const PeerCredentials&, bool*) {
    ToWire(store_.StatSnapshot(), response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* TensorShmService::Sessions(grpc::CallbackServerContext* context,
                                                     const v1::SessionsRequest*,
                                                     v1::SessionsResponse* response) {
  return Unary(context, {.counted = false}, [&](const PeerCredentials& peer, bool*) {
    // The caller's own session, if it names one; a caller without one sees the same list.
    absl::StatusOr<std::vector<SessionListing>> listed =
        store_.Sessions(peer, SessionToken(*context).value_or(""));
    if (!listed.ok()) return listed.status();
    ToWire(*listed, response);
    return absl::OkStatus();
  });
}

}  // namespace tensorshm
