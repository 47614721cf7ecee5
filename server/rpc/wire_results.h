// The Store's results as the gRPC service answers them: the wire messages of Stat, List and
// Sessions (proto/tensorshm/v1/tensorshm.proto says what each field means).
#ifndef TENSORSHM_SERVER_RPC_WIRE_RESULTS_H_
#define TENSORSHM_SERVER_RPC_WIRE_RESULTS_H_

#include <vector>

#include "server/core/listings.h"
#include "server/ops/figures.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

void ToWire(const StoreFigures& figures, v1::StatResponse* out);
void ToWire(const std::vector<TensorListing>& listed, v1::ListResponse* out);
void ToWire(const std::vector<SessionListing>& listed, v1::SessionsResponse* out);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_WIRE_RESULTS_H_
