#include "server/rpc/channel_handler.h"

#include <string>
#include <utility>

#include "server/rpc/wire_calls.h"

namespace tensorshm {

MetricOp ChannelRequestOp(const v1::ChannelRequest& request) {
  switch (request.kind_case()) {
    case v1::ChannelRequest::kBind:
      return MetricOp::kBind;
    case v1::ChannelRequest::kSegment:
      return MetricOp::kSegment;
    case v1::ChannelRequest::kFastPath:
      return MetricOp::kFastPath;
    case v1::ChannelRequest::kCreate:
      return MetricOp::kCreate;
    case v1::ChannelRequest::kPublish:
      return MetricOp::kPublish;
    case v1::ChannelRequest::kDelete:
      return MetricOp::kDelete;
    default:
      return MetricOp::kUnknown;
  }
}

ChannelReply HandleChannelRequest(Store& store, ChannelConnection& connection,
                                  const v1::ChannelRequest& request) {
  ChannelReply reply;
  reply.response.set_sequence(request.sequence());
  const absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<ChannelAsk> ask = FromWire(request);
    if (!ask.ok()) return ask.status();
    absl::StatusOr<ChannelReplied> replied =
        store.Channel(connection.peer, &connection.session_token, *ask);
    if (!replied.ok()) return replied.status();
    ToWire(replied->answer, &reply.response);
    reply.fd = std::move(replied->fd);
    return absl::OkStatus();
  }();
  store.metrics().CountOp(ChannelRequestOp(request), status);
  if (!status.ok()) {
    reply.response.set_code(static_cast<int32_t>(status.code()));
    reply.response.set_message(std::string(status.message()));
  }
  return reply;
}

}  // namespace tensorshm
