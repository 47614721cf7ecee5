#include "server/core/session.h"

#include <iterator>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/check.h"
#include "server/core/waiters.h"

namespace tensorshm {
namespace {

std::string RandomToken() {
  std::random_device device;  // the kernel's entropy pool
  std::string token;
  for (int i = 0; i < 4; ++i) absl::StrAppendFormat(&token, "%08x", device());
  return token;
}

}  // namespace

absl::Status NoSessionError(const std::string& token) {
  return absl::FailedPreconditionError(
      absl::StrCat("metadata ", kSessionMetadataKey, " = \"", absl::CHexEscape(token.substr(0, 64)),
                   "\": no open session has this id (its stream ended, or it never existed)"));
}

absl::Status Session::CheckCaller(const PeerCredentials& caller, absl::string_view field) const {
  constexpr char kRule[] = "a session serves only the process that opened it";
  if (caller.uid != uid) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: session %d was opened by uid %d; this call comes from uid %d (pid %d): %s", field, id,
        uid, caller.uid, caller.pid, kRule));
  }
  if (caller.gid != gid) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: session %d was opened with gid %d; this call comes with gid %d (uid %d, pid %d): %s",
        field, id, gid, caller.gid, caller.uid, caller.pid, kRule));
  }
  if (caller.pid != peer_pid) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: session %d was opened by pid %d; this call comes from pid %d (uid %d): %s", field, id,
        peer_pid, caller.pid, caller.uid, kRule));
  }
  return absl::OkStatus();
}

void Session::RecordGrant(uint64_t request_id, RequestGrant grant) {
  if (request_id == 0) return;
  granted_requests[request_id] = std::move(grant);
  // Grants the client took and has since let go of are of no use to a settle: dropped once they
  // outnumber what the session holds, so the map stays in proportion to it (amortised O(1)).
  if (granted_requests.size() <= 2 * (leases.size() + unpublished.size()) + 64) return;
  for (auto it = granted_requests.begin(); it != granted_requests.end();) {
    bool held = leases.count(it->second.lease_id) > 0;
    for (uint64_t tensor_id : it->second.tensor_ids) held = held || unpublished.count(tensor_id);
    it = held ? std::next(it) : granted_requests.erase(it);
  }
}

void Session::NoteSettled(uint64_t request_id) {
  if (request_id == 0) return;
  settled_requests.insert(request_id);
  if (settled_requests.size() > kMaxSettledRequests)
    settled_requests.erase(settled_requests.begin());
}

Session& SessionTable::Open(int64_t pid, std::string client_name, std::string peer) {
  auto session = std::make_unique<Session>();
  session->id = next_session_id_++;
  session->token = RandomToken();
  session->pid = pid;
  session->client_name = std::move(client_name);
  session->peer = std::move(peer);
  Session& ref = *session;
  by_token_.emplace(ref.token, &ref);
  by_id_.emplace(ref.id, std::move(session));
  return ref;
}

Session* SessionTable::Find(const std::string& token) {
  auto it = by_token_.find(token);
  return it == by_token_.end() ? nullptr : it->second;
}

void SessionTable::Close(uint64_t id) {
  auto it = by_id_.find(id);
  TSM_CHECK(it != by_id_.end());
  TSM_CHECK(it->second->leases.empty() && it->second->unpublished.empty());
  by_token_.erase(it->second->token);
  by_id_.erase(it);
}

int64_t SessionTable::lease_count() const {
  int64_t count = 0;
  for (const auto& [id, session] : by_id_) count += static_cast<int64_t>(session->leases.size());
  return count;
}

}  // namespace tensorshm
