// Holdings: what a client holds of the daemon, by client-side key (the handle its tensors keep):
// its leases, with the daemon's lease id in the current session, and its unpublished writable
// tensors; the releases, abandons and settles queued for the sender thread; and the counts
// Flush waits on. Re-registered with a restarted daemon as a whole (ForReattach, Reattached).
#ifndef TENSORSHM_CLIENT_HOLDINGS_H_
#define TENSORSHM_CLIENT_HOLDINGS_H_

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

// Thread-compatible: ClientCore's lock guards it.
class Holdings {
 public:
  // A lease held under a key.
  struct Lease {
    uint64_t tensor_id = 0;
    uint64_t lease_id = 0;  // in the current session; 0: the daemon no longer knows it
  };
  // The queues' totals at one moment; Flush waits until as many are settled.
  struct Mark {
    uint64_t releases = 0;
    uint64_t abandons = 0;
  };
  // What a reconnecting client asks the new daemon to take back, by key, in the order of
  // SessionOpen's held_tensor_ids and unpublished_tensor_ids.
  struct Reattach {
    std::vector<uint64_t> lease_keys;
    std::vector<uint64_t> unpublished_keys;
  };

  // A new lease on `tensor_id` (`lease_id` as the daemon granted it), or a new unpublished
  // tensor: each outstanding until released, published or abandoned. Returns its key.
  uint64_t AddLease(uint64_t tensor_id, uint64_t lease_id);
  uint64_t AddUnpublished(uint64_t tensor_id);
  // The lease or the unpublished tensor's id under `key`; null / nullopt if the daemon no longer
  // holds it for this client (a restart that did not take it back), or it was given back.
  const Lease* FindLease(uint64_t key) const;
  std::optional<uint64_t> UnpublishedId(uint64_t key) const;
  // The unpublished tensor `key` was published: no longer outstanding.
  void Published(uint64_t key);

  // Queues a lease's release, an unpublished tensor's abandon, a call's settle for the sender.
  void QueueRelease(uint64_t key);
  void QueueAbandon(uint64_t key);
  void QueueSettle(uint64_t request_id) { settles_.push_back(request_id); }
  bool HasQueued() const { return !releases_.empty() || !abandons_.empty() || !settles_.empty(); }
  // Nothing outstanding and no release or abandon queued (settles need no sending once the
  // client is gone: its session's end gives back what they would).
  bool Drained() const { return outstanding_ == 0 && releases_.empty() && abandons_.empty(); }
  int64_t outstanding() const { return outstanding_; }

  // Fills `batch` from the queues, at most `max_ids` ids of each kind (ids the daemon no longer
  // knows are dropped); false if it is empty.
  bool TakeBatch(v1::ReleaseBatch* batch, int max_ids);
  // What was taken so far is settled (its batch was acknowledged, or its session is gone).
  void SettleTaken() { settled_ = taken_; }
  // The session ended: what is queued needs no sending (its daemon is gone, and those leases
  // and tensors must not be re-registered); settled.
  void DropQueued();
  Mark Queued() const { return queued_; }
  bool SettledUpTo(const Mark& mark) const {
    return settled_.releases >= mark.releases && settled_.abandons >= mark.abandons;
  }

  // The leases (those the last daemon had not refused) and unpublished tensors to re-register,
  // added to `open`.
  Reattach ForReattach(v1::SessionOpen* open) const;
  // The new daemon's answer to `asked`: leases get their new ids (0 where not taken back),
  // unpublished tensors not taken back are forgotten. Returns the ids of the tensors lost.
  std::vector<uint64_t> Reattached(const Reattach& asked, const v1::SessionOpened& answer);

 private:
  std::unordered_map<uint64_t, Lease> leases_;          // by key
  std::unordered_map<uint64_t, uint64_t> unpublished_;  // key -> tensor id
  uint64_t next_key_ = 1;
  int64_t outstanding_ = 0;  // leases and unpublished tensors not yet given back or published
  std::vector<uint64_t> releases_;  // keys
  std::vector<uint64_t> abandons_;  // keys
  std::vector<uint64_t> settles_;   // request ids
  // Counted over the client's life: queued, taken into batches, and settled (acknowledged, or
  // dropped with their session). The queues are FIFO, so Flush waits until the settled counts
  // reach the queued counts it saw, however many batches that takes.
  Mark queued_;
  Mark taken_;
  Mark settled_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_HOLDINGS_H_
