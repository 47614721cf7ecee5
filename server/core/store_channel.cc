// The memory channel's requests, as the Store serves them: admitted, a publish waking the
// consumers that wait on the index at once, then carried out under the lock (ChannelDesk).
#include <string>
#include <variant>

#include "server/core/store.h"

namespace tensorshm {

absl::StatusOr<ChannelReplied> Store::Channel(const PeerCredentials& peer,
                                              std::string* session_token, const ChannelAsk& ask,
                                              const ChannelWaiters& waiters, bool* answered_later) {
  if (policy_ != nullptr) {
    if (absl::Status s = policy_->Admit(peer); !s.ok()) return s;
  }
  // A consumer waiting for the name wakes while the publish is committed, not after it (the
  // index's header needs no lock; see CatalogIndex::WakeWaiters).
  if (std::holds_alternative<PublishOrder>(ask)) index_.WakeWaiters();
  Lock lock(this);
  return channel_.Carry(peer, session_token, ask, waiters, shutting_down_, answered_later);
}

UniqueFd Store::AttachLater(const std::string& token, const TensorPlace& place,
                            std::optional<SegmentGranted>* attached) {
  Lock lock(this);
  return channel_.AttachLater(token, place, attached);
}

}  // namespace tensorshm
