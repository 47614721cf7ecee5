// Sessions: one per connected client process, each tied to its Session stream, with the leases
// it holds and the tensors it created but has not published.
#ifndef TENSORSHM_SERVER_CORE_SESSION_H_
#define TENSORSHM_SERVER_CORE_SESSION_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/core/access.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {

struct Session {
  uint64_t id = 0;
  std::string token;     // what clients send as "tensorshm-session" metadata; unguessable
  int64_t pid = 0;       // the kernel's word (SO_PEERCRED), else what the client said
  int64_t peer_pid = 0;  // SO_PEERCRED's alone: 0 when the client's pid namespace is not visible
  uint32_t uid = 0;      // from SO_PEERCRED
  uint32_t gid = 0;
  std::string client_name;
  std::string client_version;  // what the client said (SessionOpen.client_version)
  absl::Time opened_at;
  std::string peer;
  std::map<uint64_t, uint64_t> leases;       // lease id -> tensor id
  std::map<uint64_t, uint64_t> unpublished;  // tensor id -> buffer bytes, created, unpublished
  uint64_t unpublished_bytes = 0;            // their sum, held against --session-quota
  // This session's part of its uid's counts (--uid-*): the session, its RPC leases (`leases`)
  // and unpublished bytes. The Store keeps it in step; closing the session gives it all back.
  UidLimits::SessionCharge uid_charge;

  // OK if `caller` (a call's connection, as SO_PEERCRED read it) is the process that opened this
  // session: same uid, gid and kernel pid (`peer_pid`; 0 on both sides for a client whose pid
  // namespace the daemon cannot see). PERMISSION_DENIED naming what differs otherwise, never
  // the token: a token seen by another process (a forked child, a leaked log, another uid) is
  // worth nothing on its own. The opener's pid and gid are named only to a caller of the same
  // uid (as SessionsRequest shows them). `field`: what named the session, as the refusal says
  // (the call's metadata; bind.session_id on the memory channel). The one admission check of a
  // session's caller, for both transports.
  absl::Status CheckCaller(const PeerCredentials& caller,
                           absl::string_view field = "metadata tensorshm-session") const;

  // Calls carrying a request id (AcquireRequest.request_id, CreateRequest.request_id), for the
  // client's settles (ReleaseBatch.settled_request_ids; see docs/decisions.md, "Cancels are
  // settled by the daemon"). What a call granted is kept until its client settles it, or until
  // nothing of it is held any more (a lease released, tensors published or abandoned: RecordGrant
  // prunes those). Ids settled before the daemon granted anything for them wait in
  // `settled_requests` for their call (refused when it arrives, given back when it is granted).
  struct RequestGrant {
    uint64_t lease_id = 0;             // an Acquire's lease
    std::vector<uint64_t> tensor_ids;  // a Create's buffer and its stocked buffers
  };
  std::map<uint64_t, RequestGrant> granted_requests;  // by request id
  std::set<uint64_t> settled_requests;                // at most kMaxSettledRequests
  // Host segments granted writable to this session, (segment_instance, segment_id): a channel
  // create in one of them sends no descriptor along (ChannelResponse.attached_segment).
  std::set<std::pair<uint64_t, uint64_t>> writable_segments;

  // Keeps what call `request_id` (0: none, nothing kept) granted, for a settle.
  void RecordGrant(uint64_t request_id, RequestGrant grant);
  // True (and forgotten) if the client settled `request_id` before its call was granted.
  bool TakeSettled(uint64_t request_id) {
    return request_id != 0 && settled_requests.erase(request_id) > 0;
  }
  // Remembers a settle that found no grant and no waiting call: its call may still come. The
  // oldest (lowest) ids go first past kMaxSettledRequests (ids the daemon answered without a
  // grant settle to nothing and land here too; they are never used again).
  void NoteSettled(uint64_t request_id);

  // Records `tensor_id` as this session's unpublished buffer of `bytes`, charged to its uid.
  // RESOURCE_EXHAUSTED (--uid-quota) and nothing recorded if the uid has no room for it.
  // REQUIRES: `tensor_id` is not in `unpublished`.
  absl::Status AddUnpublished(uint64_t tensor_id, uint64_t bytes) {
    if (absl::Status s = uid_charge.AddUnpublished(bytes); !s.ok()) return s;
    unpublished.emplace(tensor_id, bytes);
    unpublished_bytes += bytes;
    return absl::OkStatus();
  }
  // Forgets `tensor_id` (published or freed), giving its bytes back to the uid.
  // REQUIRES: it is in `unpublished`.
  void ForgetUnpublished(uint64_t tensor_id) {
    auto it = unpublished.find(tensor_id);
    unpublished_bytes -= it->second;
    uid_charge.DropUnpublished(it->second);
    unpublished.erase(it);
  }
};

// FAILED_PRECONDITION for a call naming session `token`, which no open session has (its stream
// ended, or it never existed); the message shows the token's first 64 bytes, escaped.
absl::Status NoSessionError(const std::string& token);

// Settles remembered per session before their call arrives (Session::NoteSettled).
inline constexpr size_t kMaxSettledRequests = 1024;

// Thread-compatible: the Store serialises calls (its lock).
class SessionTable {
 public:
  // Registers a new session and returns it; its token is 128 random bits in hex.
  Session& Open(int64_t pid, std::string client_name, std::string peer);
  // The session with `token`, or nullptr.
  Session* Find(const std::string& token);
  // Removes the session. REQUIRES: its leases and unpublished tensors have been dealt with.
  void Close(uint64_t id);
  // A fresh lease id, unique for the daemon's lifetime.
  uint64_t NextLeaseId() { return next_lease_id_++; }

  // Every open session, by id.
  const std::map<uint64_t, std::unique_ptr<Session>>& by_id() const { return by_id_; }

  int64_t size() const { return static_cast<int64_t>(by_id_.size()); }
  int64_t lease_count() const;

 private:
  uint64_t next_session_id_ = 1;
  uint64_t next_lease_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Session>> by_id_;
  std::unordered_map<std::string, Session*> by_token_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_SESSION_H_
