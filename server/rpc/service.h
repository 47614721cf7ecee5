// The gRPC service: a thin adapter between the wire (calls, reactors, proto messages) and the
// Store (server/core/store.h), which holds the state and the rules. The Daemon owns the Store;
// this service and the memory channel's handler (channel_handler.h) are its two transports.
#ifndef TENSORSHM_SERVER_RPC_SERVICE_H_
#define TENSORSHM_SERVER_RPC_SERVICE_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "server/core/store.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {

// Thread-safe (the Store is). gRPC's callback API: no call holds a thread while it waits. Unary
// calls are answered on the gRPC thread that runs them, except those the Store answers later (a
// create that needs a new pool segment, answered by Store::GrowPools; a create waiting for
// memory; an Acquire waiting for a publish), each a reactor the Store holds as a PendingCall. A
// Session stream is a reactor that reads one request, answers it and reads the next. Reactors
// are always finished with the Store's lock released (gRPC may run OnCancel and OnDone inline).
class TensorShmService final : public v1::TensorShm::CallbackService {
 public:
  // Serves `store`, which outlives the service. `cross_cancel_hold`: the store's
  // StoreTestHooks::cross_cancel_hold (zero in production): answers carrying a grant leave this
  // much later.
  TensorShmService(Store& store, absl::Duration cross_cancel_hold);
  ~TensorShmService();

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
  grpc::ServerUnaryReactor* Sessions(grpc::CallbackServerContext* context,
                                     const v1::SessionsRequest* request,
                                     v1::SessionsResponse* response) override;

 private:
  class SessionReactor;  // service_reactors.cc
  class Waiter;          // service_reactors.cc
  class CreateWaiter;    // service_reactors.cc
  class LaterAnswer;     // service.cc

  // How Unary() opens and closes a call.
  struct UnaryFrame {
    MetricOp op = MetricOp::kCount;
    bool counted = true;  // false: the call is not counted in metrics() (Sessions)
    // The call's reactor; null: the context's default reactor.
    grpc::ServerUnaryReactor* reactor = nullptr;
    // The call's request id (0: none): an OK answer to it carries a grant (FinishGranting).
    uint64_t request_id = 0;
  };
  // The frame every unary handler shares: Admit, then `body` with what Admit returned (the Store
  // call, which sets `*answered_later` when the Store answers the call itself, later); then
  // counts the answer in metrics() and finishes the reactor with it (FinishGranting). Returns the
  // reactor, for gRPC.
  grpc::ServerUnaryReactor* Unary(
      grpc::CallbackServerContext* context, const UnaryFrame& frame,
      absl::FunctionRef<absl::Status(const PeerCredentials& peer, bool* answered_later)> body);
  // Create's work for a create with wait_ms != 0: a CreateWaiter, answered at once when it can
  // be, else by the Store once served (Store::CreateWaiting). (service_reactors.cc)
  grpc::ServerUnaryReactor* CreateWaiting(grpc::CallbackServerContext* context,
                                          const v1::CreateRequest* request,
                                          v1::CreateResponse* response);
  // The caller's credentials if the policy admits it; PERMISSION_DENIED otherwise.
  absl::StatusOr<PeerCredentials> Admit(const grpc::ServerContextBase& context) const;
  // The session token the call's metadata names; nullopt if none.
  static std::optional<std::string> SessionToken(const grpc::ServerContextBase& context);
  // Finishes `reactor` with `status`; `granted`: it carries a grant of a call with a request id
  // (held back by cross_cancel_hold_ in tests).
  void FinishGranting(grpc::ServerUnaryReactor* reactor, grpc::Status status, bool granted);

  Store& store_;
  const absl::Duration cross_cancel_hold_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_SERVICE_H_
