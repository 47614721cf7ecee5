// The memory channel's handler: a thin adapter between the channel's requests (ChannelRequest in
// the .proto, carried by memory_channel.h's ChannelServer) and the Store, which carries them out
// (Store::Channel), reading and writing the messages (wire_calls.h). The gRPC service (service.h)
// is the Store's other transport.
#ifndef TENSORSHM_SERVER_RPC_CHANNEL_HANDLER_H_
#define TENSORSHM_SERVER_RPC_CHANNEL_HANDLER_H_

#include "absl/time/time.h"
#include "server/core/store.h"
#include "server/rpc/memory_channel.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

// The operation `request` counts as in the metrics (kUnknown for none the Store carries out).
MetricOp ChannelRequestOp(const v1::ChannelRequest& request);

// Answers one memory channel request: Store::Channel for `connection`'s peer and session, counted
// in the store's metrics. Refusals are in the response's code and message. Thread-safe (the Store
// is).
// A create that waits is answered later through connection.link (ChannelReply::deferred); a
// ChannelCancel gives up on the one it names. `cross_cancel_hold` (a test hook, zero in
// production): a granting answer sent later leaves that much later, so that a test's cancel
// crosses it.
ChannelReply HandleChannelRequest(Store& store, ChannelConnection& connection,
                                  const v1::ChannelRequest& request,
                                  absl::Duration cross_cancel_hold = absl::ZeroDuration());

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_CHANNEL_HANDLER_H_
