#include "server/core/session_desk.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/check.h"
#include "server/ops/log.h"

namespace tensorshm {
namespace {

// Ids of each kind one ReleaseBatch may carry (clients send at most 4096): each refused id costs
// a Rejection in the ack, many times its own size.
constexpr size_t kMaxReleaseIds = 16384;

}  // namespace

SessionDesk::SessionDesk(Catalog& catalog, SessionTable& sessions, Leasing& leasing,
                         AcquireWaits& acquire_waits, CreateQueue& create_queue,
                         UidLimits& uid_limits, Metrics& metrics, const AccessPolicy* policy)
    : catalog_(catalog),
      sessions_(sessions),
      leasing_(leasing),
      acquire_waits_(acquire_waits),
      create_queue_(create_queue),
      uid_limits_(uid_limits),
      metrics_(metrics),
      policy_(policy) {}

absl::StatusOr<OpenedSession> SessionDesk::Open(const PeerCredentials& peer,
                                                const std::string& peer_address,
                                                const SessionOpening& open) {
  // Per-uid limits: the reattach list is bounded, and the session counts against its uid.
  if (absl::Status s = uid_limits_.CheckHeldList(open.held_tensor_ids.size()); !s.ok()) return s;
  absl::StatusOr<UidLimits::SessionCharge> charge = uid_limits_.OpenSession(peer.uid);
  if (!charge.ok()) return charge.status();
  Session& session = sessions_.Open(open.pid, open.client_name, peer_address);
  session.client_version = open.client_version;
  session.opened_at = absl::Now();
  session.uid_charge = *std::move(charge);
  session.uid = peer.uid;
  session.gid = peer.gid;
  if (peer.pid != 0) session.pid = peer.pid;  // the kernel's word over the client's
  session.peer_pid = peer.pid;
  OpenedSession opened;
  opened.session_number = session.id;
  opened.token = session.token;
  Reattach(session, open, &opened);
  opened.instance_id = catalog_.instance_id();
  const HostPool& pool = catalog_.host_pool();
  for (uint64_t id = 1; id <= pool.segment_count(); ++id) {
    if (!pool.HasSegment(id)) continue;  // lost in a restart
    opened.segments.emplace_back(pool.SegmentInstance(id), id);
  }
  return opened;
}

void SessionDesk::Reattach(Session& session, const SessionOpening& open, OpenedSession* opened) {
  if (open.held_tensor_ids.empty() && open.unpublished_tensor_ids.empty()) return;
  int leases = 0;
  for (uint64_t tensor_id : open.held_tensor_ids) {
    uint64_t lease = 0;
    // A lease past the uid's --uid-leases is not taken back (its client reports the loss).
    const bool room = session.uid_charge.AddLeases().ok();
    if (room && catalog_.ReattachLease(tensor_id).ok()) {
      lease = sessions_.NextLeaseId();
      session.leases.emplace(lease, tensor_id);
      ++leases;
    } else if (room) {
      session.uid_charge.DropLeases();
    }
    opened->lease_ids.push_back(lease);
  }
  int readopted = 0;
  for (uint64_t tensor_id : open.unpublished_tensor_ids) {
    // Charged before it is taken back: a buffer past the uid's --uid-quota is not.
    const Tensor* tensor = catalog_.FindId(tensor_id);
    bool ok = tensor != nullptr && session.unpublished.count(tensor_id) == 0 &&
              session.AddUnpublished(tensor_id, tensor->buffer.length).ok();
    if (ok && !catalog_.Readopt(session.id, session.uid, tensor_id).ok()) {
      session.ForgetUnpublished(tensor_id);
      ok = false;
    }
    if (ok) ++readopted;
    opened->readopted.push_back(ok);
  }
  TSM_LOG(kInfo) << "session " << session.id << " reconnected: " << leases << " of "
                 << open.held_tensor_ids.size() << " leases and " << readopted << " of "
                 << open.unpublished_tensor_ids.size() << " unpublished tensors taken back";
}

ReleasesDone SessionDesk::Release(Session& session, const Releases& batch) {
  ReleasesDone done;
  done.sequence = batch.sequence;
  if (batch.lease_ids.size() > kMaxReleaseIds ||
      batch.abandoned_tensor_ids.size() > kMaxReleaseIds) {
    done.refused.push_back(
        {0, absl::InvalidArgumentError(
                absl::StrCat("lease_ids: ", batch.lease_ids.size(), " ids, abandoned_tensor_ids: ",
                             batch.abandoned_tensor_ids.size(), " ids; at most ", kMaxReleaseIds,
                             " of each per batch: nothing in this batch was released; send "
                             "it in smaller ones"))});
    return done;
  }
  for (size_t i = 0; i < batch.lease_ids.size(); ++i) {
    const uint64_t lease = batch.lease_ids[i];
    if (!leasing_.DropLease(session, lease)) {
      done.refused.push_back(
          {lease, absl::FailedPreconditionError(
                      absl::StrCat("lease_ids[", i, "] = ", lease, ": not held by this session"))});
    }
  }
  for (size_t i = 0; i < batch.abandoned_tensor_ids.size(); ++i) {
    const uint64_t tensor_id = batch.abandoned_tensor_ids[i];
    absl::Status status = session.unpublished.count(tensor_id) == 0
                              ? absl::FailedPreconditionError(
                                    absl::StrCat("abandoned_tensor_ids[", i, "] = ", tensor_id,
                                                 ": not an unpublished tensor of this session"))
                              : catalog_.Abandon(session.id, tensor_id);
    if (status.ok()) {
      session.ForgetUnpublished(tensor_id);
      continue;
    }
    done.refused.push_back({tensor_id, std::move(status)});
  }
  for (uint64_t request_id : batch.settled_request_ids) Settle(session, request_id);
  // What the session's lease page let go of is freed by the time the batch is acknowledged
  // (Client::Flush relies on it).
  catalog_.Reclaim();
  return done;
}

void SessionDesk::Settle(Session& session, uint64_t request_id) {
  if (request_id == 0) return;
  // Granted: given back (whatever of it the client cannot know it holds).
  if (auto it = session.granted_requests.find(request_id); it != session.granted_requests.end()) {
    leasing_.GiveBack(session, it->second);
    session.granted_requests.erase(it);
    return;
  }
  // Waiting (the client gave up before the daemon heard of it): ends now, with nothing granted.
  if (acquire_waits_.Settle(session.id, request_id)) return;
  if (create_queue_.Settle(session.id, request_id)) return;
  // Not arrived yet, answered without a grant, or being made (GrowPools): KeepCreated and the
  // calls' arrival look here.
  session.NoteSettled(request_id);
}

SessionDesk::Ended SessionDesk::Close(Session& session, bool keep_held) {
  const uint64_t session_id = session.id;
  const absl::Status ended = NoSessionError(session.token);
  acquire_waits_.FailSession(session_id, ended);
  create_queue_.FailSession(session_id, ended);
  Ended what{.leases = session.leases.size(),
             .unpublished = session.unpublished.size(),
             .kept = keep_held};
  if (keep_held) {
    // The segments stay for the next daemon: nothing the session held is freed, as if the
    // daemon had crashed (its records stay unbound or unpublished, its lease page untouched).
    // Its client re-registers the leases and takes back the unpublished buffers in the next
    // daemon's grace period; that daemon frees what nobody took back.
    what.leases += static_cast<size_t>(catalog_.PageLeasesOf(session_id));
    session.leases.clear();
    session.unpublished.clear();
  } else {
    uint64_t unpublished_bytes = 0;
    for (const auto& [tensor_id, bytes] : session.unpublished) unpublished_bytes += bytes;
    for (const auto& [lease, tensor_id] : session.leases) catalog_.DropLease(tensor_id);
    session.leases.clear();
    for (const auto& [tensor_id, bytes] : session.unpublished) {
      absl::Status s = catalog_.Abandon(session_id, tensor_id);
      TSM_CHECK(s.ok());
    }
    session.unpublished.clear();
    // Its lease page goes whole: what only it held is freed now.
    const int64_t page_leases = catalog_.DropLeasePage(session_id);
    metrics_.CountReclaimed(unpublished_bytes, what.unpublished, what.leases + page_leases);
    catalog_.Reclaim();
  }
  sessions_.Close(session_id);  // `session` is gone from here
  return what;
}

absl::StatusOr<std::vector<SessionListing>> SessionDesk::List(const PeerCredentials& caller,
                                                              const std::string& own_token) {
  // Naming a session is for its own process only, as on every call (Session::CheckCaller); a
  // token that names no open session marks none as `own`.
  if (const Session* own = sessions_.Find(own_token); own != nullptr) {
    if (absl::Status s = own->CheckCaller(caller); !s.ok()) return s;
  }
  std::vector<SessionListing> listed;
  for (const auto& [id, session] : sessions_.by_id()) {
    SessionListing& entry = listed.emplace_back();
    entry.session_id = id;
    entry.uid = session->uid;
    entry.rpc_leases = static_cast<int64_t>(session->leases.size());
    entry.page_leases = catalog_.PageLeasesOf(id);
    entry.unpublished_tensors = static_cast<int64_t>(session->unpublished.size());
    entry.unpublished_bytes = static_cast<int64_t>(session->unpublished_bytes);
    entry.opened_unix_ms = absl::ToUnixMillis(session->opened_at);
    entry.own = !own_token.empty() && own_token == session->token;
    entry.waiting_acquires = static_cast<int64_t>(acquire_waits_.CountOfSession(id));
    if (!SeesDetailsOf(policy_, caller, session->uid)) {
      entry.redacted = true;
      continue;
    }
    entry.pid = session->pid;
    entry.gid = session->gid;
    // Both at most kMaxClientText bytes (ValidateSessionOpen).
    entry.client_name = session->client_name;
    entry.client_version = session->client_version;
  }
  return listed;
}

}  // namespace tensorshm
