// Publisher: the names tensors are bound under: a session's publish (with its acquire and stock
// when asked), its delete, and the listing of what is bound.
#ifndef TENSORSHM_SERVER_CORE_PUBLISHER_H_
#define TENSORSHM_SERVER_CORE_PUBLISHER_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/catalog/catalog.h"
#include "server/core/access.h"
#include "server/core/acquire_waits.h"
#include "server/core/creator.h"
#include "server/core/growth_queue.h"
#include "server/core/leasing.h"
#include "server/core/listings.h"
#include "server/core/session.h"
#include "server/core/tensor_calls.h"

namespace tensorshm {

// Thread-compatible: the Store's lock guards it and everything it refers to.
class Publisher {
 public:
  // All outlive it; `policy` may be null (every session may change every name).
  Publisher(Catalog& catalog, Leasing& leasing, AcquireWaits& acquire_waits, Creator& creator,
            GrowthQueue& growth, const AccessPolicy* policy);
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Publishes `order.tensor_id`, an unpublished buffer of `session`, under `order.name`, and
  // answers the acquires waiting for the name.
  absl::StatusOr<Published> Publish(Session& session, const PublishOrder& order);
  // Unbinds `name` (its memory goes with its last lease).
  absl::Status Delete(const Session& session, const std::string& name);
  // The names bound under `prefix` ("" for all), by name, as `caller` may see them.
  std::vector<TensorListing> List(const PeerCredentials& caller, const std::string& prefix);

 private:
  // OK if `session` may delete or replace `tensor`: its publisher's uid, or the daemon's.
  absl::Status MayChange(const Session& session, const Tensor& tensor,
                         absl::string_view verb) const;

  Catalog& catalog_;
  Leasing& leasing_;
  AcquireWaits& acquire_waits_;
  Creator& creator_;
  GrowthQueue& growth_;
  const AccessPolicy* const policy_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_PUBLISHER_H_
