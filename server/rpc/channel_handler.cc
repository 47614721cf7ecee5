#include "server/rpc/channel_handler.h"

#include <string>
#include <utility>

namespace tensorshm {

ChannelReply HandleChannelRequest(Store& store, ChannelConnection& connection,
                                  const v1::ChannelRequest& request) {
  ChannelReply reply;
  reply.response.set_sequence(request.sequence());
  absl::StatusOr<UniqueFd> fd =
      store.Channel(connection.peer, &connection.session_token, request, &reply.response);
  const absl::Status status = fd.status();
  if (fd.ok()) reply.fd = *std::move(fd);
  store.metrics().CountOp(ChannelRequestOp(request), status);
  if (!status.ok()) {
    reply.response.clear_kind();
    reply.response.set_code(static_cast<int32_t>(status.code()));
    reply.response.set_message(std::string(status.message()));
  }
  return reply;
}

}  // namespace tensorshm
