// The Sessions RPC: every open session, for operators (tensorshmctl sessions).
#include <string>

#include "absl/time/time.h"
#include "server/rpc/service.h"

namespace tensorshm {

bool TensorShmService::SeesDetailsOf(const PeerCredentials& caller, uint32_t uid) const {
  return policy_ == nullptr || caller.uid == uid || caller.uid == policy_->owner() ||
         caller.uid == 0;
}

grpc::ServerUnaryReactor* TensorShmService::Sessions(grpc::CallbackServerContext* context,
                                                     const v1::SessionsRequest*,
                                                     v1::SessionsResponse* response) {
  const UnaryFrame frame{.counted = false, .needs_session = false};
  return Unary(context, frame, [&](UnaryCall& call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const PeerCredentials& caller = call.peer;
    // The caller's own session, if it names one; a caller without one sees the same list.
    std::string own_token;
    const auto& metadata = context->client_metadata();
    if (auto it = metadata.find(kSessionMetadataKey); it != metadata.end()) {
      own_token.assign(it->second.data(), it->second.size());
    }
    // Naming a session is for its own process only, as on every call (Session::CheckCaller); a
    // token that names no open session marks none as `own`.
    if (const tensorshm::Session* own = sessions_.Find(own_token); own != nullptr) {
      if (absl::Status s = own->CheckCaller(caller); !s.ok()) return s;
    }
    for (const auto& [id, session] : sessions_.by_id()) {
      v1::SessionInfo* info = response->add_sessions();
      info->set_session_id(id);
      info->set_uid(session->uid);
      info->set_rpc_leases(static_cast<int64_t>(session->leases.size()));
      info->set_page_leases(catalog_->PageLeasesOf(id));
      info->set_unpublished_tensors(static_cast<int64_t>(session->unpublished.size()));
      info->set_unpublished_bytes(static_cast<int64_t>(session->unpublished_bytes));
      info->set_opened_unix_ms(absl::ToUnixMillis(session->opened_at));
      info->set_own(!own_token.empty() && own_token == session->token);
      if (const size_t waiting = acquires_waiting_.CountOfSession(id); waiting > 0) {
        info->set_waiting_acquires(static_cast<int64_t>(waiting));
      }
      if (!SeesDetailsOf(caller, session->uid)) {
        info->set_redacted(true);
        continue;
      }
      info->set_pid(session->pid);
      info->set_gid(session->gid);
      // Both at most kMaxClientText bytes (ValidateSessionOpen).
      info->set_client_name(session->client_name);
      info->set_client_version(session->client_version);
    }
    return absl::OkStatus();
  });
}

}  // namespace tensorshm
