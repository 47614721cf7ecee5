// The memory channel's requests (see ChannelRequest in the .proto), carried out by the Store
// (Store::Channel) and counted here.
#include <string>

#include "server/rpc/service.h"

namespace tensorshm {

ChannelReply TensorShmService::HandleChannel(ChannelConnection& connection,
                                             const v1::ChannelRequest& request) {
  ChannelReply reply;
  reply.response.set_sequence(request.sequence());
  absl::StatusOr<UniqueFd> fd =
      store_.Channel(connection.peer, &connection.session_token, request, &reply.response);
  const absl::Status status = fd.status();
  if (fd.ok()) reply.fd = *std::move(fd);
  store_.metrics().CountOp(ChannelRequestOp(request), status);
  if (!status.ok()) {
    reply.response.clear_kind();
    reply.response.set_code(static_cast<int32_t>(status.code()));
    reply.response.set_message(std::string(status.message()));
  }
  return reply;
}

}  // namespace tensorshm
