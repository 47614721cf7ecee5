// Between the Store's own terms and the gRPC service's messages: the results of Stat, List and
// Sessions, and the session stream's open and releases (proto/tensorshm/v1/tensorshm.proto says
// what each field means).
#ifndef TENSORSHM_SERVER_RPC_WIRE_RESULTS_H_
#define TENSORSHM_SERVER_RPC_WIRE_RESULTS_H_

#include <vector>

#include "server/core/listings.h"
#include "server/core/session_calls.h"
#include "server/ops/figures.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

void ToWire(const StoreFigures& figures, v1::StatResponse* out);
void ToWire(const std::vector<TensorListing>& listed, v1::ListResponse* out);
void ToWire(const std::vector<SessionListing>& listed, v1::SessionsResponse* out);

SessionOpening FromWire(const v1::SessionOpen& open);
void ToWire(const OpenedSession& opened, v1::SessionOpened* out);
Releases FromWire(const v1::ReleaseBatch& batch);
void ToWire(const ReleasesDone& done, v1::ReleaseAck* out);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_WIRE_RESULTS_H_
