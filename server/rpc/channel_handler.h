// The memory channel's handler: a thin adapter between the channel's requests (ChannelRequest in
// the .proto, carried by memory_channel.h's ChannelServer) and the Store, which carries them out
// (Store::Channel), reading and writing the messages (wire_calls.h). The gRPC service (service.h)
// is the Store's other transport.
#ifndef TENSORSHM_SERVER_RPC_CHANNEL_HANDLER_H_
#define TENSORSHM_SERVER_RPC_CHANNEL_HANDLER_H_

#include "server/core/store.h"
#include "server/rpc/memory_channel.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

// The operation `request` counts as in the metrics (kUnknown for none the Store carries out).
MetricOp ChannelRequestOp(const v1::ChannelRequest& request);

// Answers one memory channel request: Store::Channel for `connection`'s peer and session, counted
// in the store's metrics. Refusals are in the response's code and message. Thread-safe (the Store
// is).
ChannelReply HandleChannelRequest(Store& store, ChannelConnection& connection,
                                  const v1::ChannelRequest& request);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_CHANNEL_HANDLER_H_
