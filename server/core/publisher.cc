#include "server/core/publisher.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/tensor/layout.h"
#include "common/tensor/name.h"

namespace tensorshm {

Publisher::Publisher(Catalog& catalog, Leasing& leasing, AcquireWaits& acquire_waits,
                     Creator& creator, GrowthQueue& growth, const AccessPolicy* policy)
    : catalog_(catalog),
      leasing_(leasing),
      acquire_waits_(acquire_waits),
      creator_(creator),
      growth_(growth),
      policy_(policy) {}

absl::Status Publisher::MayChange(const Session& session, const Tensor& tensor,
                                  absl::string_view verb) const {
  if (policy_ == nullptr || session.uid == tensor.owner_uid || session.uid == policy_->owner()) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "name = \"", tensor.name, "\": published by uid ", tensor.owner_uid, "; uid ", session.uid,
      " may not ", verb, " it (only its publisher and the daemon's uid may)"));
}

absl::StatusOr<Published> Publisher::Publish(Session& session, const PublishOrder& order) {
  if (absl::Status s = ValidateName(order.name); !s.ok()) return s;
  if (const Tensor* bound = catalog_.Find(order.name); bound != nullptr && order.replace) {
    if (absl::Status s = MayChange(session, *bound, "replace"); !s.ok()) return s;
  }
  if (!order.ready_event.empty()) {
    const Tensor* tensor = catalog_.FindId(order.tensor_id);
    if (order.ready_event.size() != sizeof(CUipcEventHandle)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ready_event: ", order.ready_event.size(), " bytes; must be empty or a ",
                       sizeof(CUipcEventHandle), "-byte CUipcEventHandle"));
    }
    if (tensor != nullptr && tensor->device.device_type != kDLCUDA) {
      return absl::InvalidArgumentError(absl::StrCat("ready_event: set for tensor ", tensor->id,
                                                     " on ", DeviceName(tensor->device),
                                                     "; only CUDA tensors take one"));
    }
  }
  if (order.spec.has_value()) {
    const TensorSpec& spec = *order.spec;
    if (absl::Status s = catalog_.Reshape(session.id, order.tensor_id, spec.dtype, spec.shape,
                                          spec.strides, spec.subbyte_padded);
        !s.ok()) {
      return s;
    }
  }
  // The lease of publish-and-acquire is charged first: over --uid-leases nothing is published.
  if (order.acquire) {
    if (absl::Status s = session.uid_charge.AddLeases(); !s.ok()) return s;
  }
  absl::Status s = catalog_.Publish(session.id, order.tensor_id, order.name, order.replace,
                                    order.ready_event, session.pid);
  if (!s.ok()) {
    if (order.acquire) session.uid_charge.DropLeases();
    return s;
  }
  session.ForgetUnpublished(order.tensor_id);
  Published published;
  if (order.acquire) {
    const Tensor* tensor = catalog_.FindId(order.tensor_id);
    TSM_CHECK(tensor != nullptr);
    published.acquired = leasing_.Grant(session, *tensor);
  }
  acquire_waits_.Wake(order.name);
  if (order.stock > 0) {
    published.stocked = creator_.Stock(session, order.stock_bytes, order.stock);
    growth_.Ahead(session.uid);
  }
  return published;
}

absl::Status Publisher::Delete(const Session& session, const std::string& name) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (const Tensor* bound = catalog_.Find(name); bound != nullptr) {
    if (absl::Status s = MayChange(session, *bound, "delete"); !s.ok()) return s;
  }
  return catalog_.Delete(name);
}

std::vector<TensorListing> Publisher::List(const PeerCredentials& caller,
                                           const std::string& prefix) {
  catalog_.ReadLeasePages();  // once: each entry's page leases are then a look-up
  std::vector<TensorListing> listed;
  for (const Tensor* tensor : catalog_.List(prefix)) {
    TensorListing& entry = listed.emplace_back();
    entry.name = tensor->name;
    entry.tensor_id = tensor->id;
    entry.desc = Leasing::DescriptionOf(*tensor);
    entry.leases = catalog_.LeaseCount(*tensor);
    entry.published_unix_ms = tensor->published_unix_ms;
    entry.publisher_uid = tensor->owner_uid;
    if (SeesDetailsOf(policy_, caller, tensor->owner_uid)) {
      entry.publisher_pid = tensor->publisher_pid;
    }
  }
  return listed;
}

}  // namespace tensorshm
