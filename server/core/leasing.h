// Leasing: what a call answers about a tensor (its layout, where its bytes lie), the leases a
// session holds on tensors, and what calls with a request id granted, kept for the client's
// settle: issued and given back in one place for every call that grants or drops one (acquire,
// publish-and-acquire, create, releases, settles, a cancelled answer).
#ifndef TENSORSHM_SERVER_CORE_LEASING_H_
#define TENSORSHM_SERVER_CORE_LEASING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/catalog/catalog.h"
#include "server/core/session.h"
#include "server/core/tensor_calls.h"

namespace tensorshm {

// Thread-compatible: the Store's lock guards it (and the catalog and sessions it refers to).
class Leasing {
 public:
  // `catalog` and `sessions` outlive it.
  Leasing(Catalog& catalog, SessionTable& sessions) : catalog_(catalog), sessions_(sessions) {}
  Leasing(const Leasing&) = delete;
  Leasing& operator=(const Leasing&) = delete;

  // A tensor's layout as clients read it.
  static DecodedTensor DescriptionOf(const Tensor& tensor);
  // Where a tensor's bytes lie, as clients map them.
  TensorPlace PlaceOf(const Tensor& tensor) const;

  // A new lease of `session` on `tensor` (sealed), as an Acquire answers it.
  // REQUIRES: the lease is charged to session.uid_charge already.
  LeaseGrant Grant(Session& session, const Tensor& tensor);
  // Records a new lease of `session` on `tensor` and returns its id. REQUIRES: as Grant.
  uint64_t AddLease(Session& session, const Tensor& tensor);
  // Gives back lease `lease_id` of `session` (its tensor's lease and the uid's charge); false if
  // the session holds no such lease.
  bool DropLease(Session& session, uint64_t lease_id);
  // Gives back what `grant` holds that `session` still holds: the lease, unpublished tensors.
  void GiveBack(Session& session, const Session::RequestGrant& grant);

  // Ids of the tensors a create's answer carries (its own and the stocked ones).
  static std::vector<uint64_t> IdsOf(const Created& created);
  // After a create of call `request_id` by the session with `token` made `created`: kept for a
  // settle (OK), or given back at once if the client settled the call already (CANCELLED), or
  // the session's `gone` if it ended.
  absl::Status KeepCreated(const std::string& token, const absl::Status& gone, uint64_t request_id,
                           const Created& created);

 private:
  Catalog& catalog_;
  SessionTable& sessions_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_LEASING_H_
