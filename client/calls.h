// What the client's calls share: how a call's failure is read (was it granted all the same?),
// and the memory channel with the RPC as its fallback. Private to the client library.
#ifndef TENSORSHM_CLIENT_CALLS_H_
#define TENSORSHM_CLIENT_CALLS_H_

#include <grpcpp/client_context.h>

#include <chrono>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client_core.h"
#include "common/tensor/grpc_status.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {

// absl here predates its use of std::string_view, so names cross over explicitly.
inline absl::string_view View(std::string_view text) {
  return absl::string_view(text.data(), text.size());
}

// CANCELLED for a wait on `what` that its WaitCanceller ended.
inline absl::Status Cancelled(std::string_view what) {
  return absl::CancelledError(absl::StrCat(View(what), ": the wait was cancelled"));
}

// Whether a call that failed with `status` may have been granted by the daemon all the same: the
// failure was the call's (a cancel, its deadline, its connection), not the daemon's answer, and
// could have crossed an OK answer. Such a call is settled (ClientCore::QueueSettle). The daemon
// answers DEADLINE_EXCEEDED itself before the call's own deadline, which is later (a wait's
// timeout + kCallTimeout): only an expiry here is the call's.
inline bool MayHaveBeenGranted(const absl::Status& status, const grpc::ClientContext& context) {
  switch (status.code()) {
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kAborted:
      return true;
    case absl::StatusCode::kDeadlineExceeded:
      return std::chrono::system_clock::now() >= context.deadline();
    default:
      return false;
  }
}

// Sends `call` (holding `request`) over the memory channel, and the answer's field to
// `*response`; only when the channel cannot be had, makes the unary RPC `rpc` instead.
template <typename Request, typename Response>
absl::Status ChannelOrRpc(ClientCore& core, v1::ChannelRequest& call,
                          Response* (v1::ChannelResponse::*field)(),
                          grpc::Status (v1::TensorShm::Stub::*rpc)(grpc::ClientContext*,
                                                                   const Request&, Response*),
                          const Request& request, Response* response) {
  absl::StatusOr<v1::ChannelResponse> answer = core.Exchange(call);
  if (answer.ok()) {
    *response = std::move(*((*answer).*field)());
    return absl::OkStatus();
  }
  // The RPC only if the channel cannot be had: not after the daemon may have seen the request.
  if (!ChannelNotHad(answer.status())) return answer.status();
  grpc::ClientContext context;
  core.PrepareContext(context, kCallTimeout);
  return FromGrpcStatus(((*core.stub()).*rpc)(&context, request, response));
}

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_CALLS_H_
