// Sessions, as the Store serves them (the work is SessionDesk's): a Session stream's open, its
// release batches, its close; and every open session for operators (the Sessions RPC,
// tensorshmctl sessions).
#include <optional>
#include <string>

#include "common/tensor/name.h"
#include "server/core/store.h"
#include "server/ops/log.h"

namespace tensorshm {

absl::StatusOr<std::vector<SessionListing>> Store::Sessions(const PeerCredentials& caller,
                                                            const std::string& own_token) {
  Lock lock(this);
  return session_desk_.List(caller, own_token);
}

absl::StatusOr<OpenedSession> Store::OpenSession(const PeerCredentials& peer,
                                                 const std::string& peer_address,
                                                 const SessionOpening& open) {
  // The client's own words are kept for the session's life (Sessions, logs): bounded.
  if (absl::Status s = ValidateClientText(open.client_name, open.client_version); !s.ok()) {
    return s;
  }
  absl::StatusOr<OpenedSession> opened;
  {
    Lock lock(this);
    if (shutting_down_) return absl::UnavailableError("tensorshmd is stopping");
    opened = session_desk_.Open(peer, peer_address, open);
  }
  if (!opened.ok()) return opened;
  TSM_LOG(kInfo) << "session " << opened->session_number << " opened: pid " << open.pid << ", uid "
                 << peer.uid << ", client \"" << LogEscape(open.client_name) << "\", "
                 << peer_address;
  return opened;
}

std::optional<ReleasesDone> Store::SessionRelease(const std::string& token, const Releases& batch) {
  Lock lock(this);
  tensorshm::Session* session = sessions_.Find(token);
  if (session == nullptr) return std::nullopt;
  return session_desk_.Release(*session, batch);
}

void Store::CloseSession(uint64_t session_id, const std::string& token) {
  SessionDesk::Ended ended;
  {
    Lock lock(this);
    tensorshm::Session* session = sessions_.Find(token);
    if (session == nullptr) return;
    ended = session_desk_.Close(*session, keep_held_on_stop_);
  }
  if (ended.kept) {
    TSM_LOG(kInfo) << "session " << session_id << " ended by the stop: kept its " << ended.leases
                   << " leases and " << ended.unpublished
                   << " unpublished tensors for the next daemon (--keep-segments)";
    return;
  }
  TSM_LOG(kInfo) << "session " << session_id << " closed: released " << ended.leases
                 << " leases, freed " << ended.unpublished << " unpublished tensors";
}

}  // namespace tensorshm
