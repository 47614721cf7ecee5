// Between the Store's own terms for a session's calls on tensors (server/core/tensor_calls.h) and
// the messages of the gRPC service and the memory channel (proto/tensorshm/v1/tensorshm.proto says
// what each field means). Reading a request validates what the Store cannot check once it is
// read (a dtype's fields), and names the field it refuses.
#ifndef TENSORSHM_SERVER_RPC_WIRE_CALLS_H_
#define TENSORSHM_SERVER_RPC_WIRE_CALLS_H_

#include "absl/status/statusor.h"
#include "server/core/tensor_calls.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

absl::StatusOr<CreateOrder> FromWire(const v1::CreateRequest& request);
void ToWire(const Created& created, v1::CreateResponse* out);
absl::StatusOr<PublishOrder> FromWire(const v1::PublishRequest& request);
void ToWire(const Published& published, v1::PublishResponse* out);
AcquireOrder FromWire(const v1::AcquireRequest& request);
void ToWire(const LeaseGrant& lease, v1::AcquireResponse* out);
void ToWire(const TensorPlace& place, v1::Location* out);

// A memory channel request: INVALID_ARGUMENT naming `kind` if it is none the Store carries out
// (`expect` is the channel's own).
absl::StatusOr<ChannelAsk> FromWire(const v1::ChannelRequest& request);
// The answer's kind, and the segment a create brings along; the rest of `out` is left as it is.
void ToWire(const ChannelAnswer& answer, v1::ChannelResponse* out);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_WIRE_CALLS_H_
