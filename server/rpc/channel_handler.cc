#include "server/rpc/channel_handler.h"

#include <memory>
#include <string>
#include <utility>

namespace tensorshm {
namespace {

// Fills `response`'s refusal from `status` (no kind set).
void Refuse(const absl::Status& status, v1::ChannelResponse* response) {
  response->clear_kind();
  response->set_code(static_cast<int32_t>(status.code()));
  response->set_message(std::string(status.message()));
}

// A channel create whose pool had to grow first, answered by GrowPools through the connection's
// link (or not at all, the connection closed meanwhile: the buffer is the session's until it
// ends). Owns its request and response until then; goes once answered.
class LaterCreate final : public PendingCall {
 public:
  LaterCreate(Store& store, std::shared_ptr<ChannelLink> link, std::string token, uint64_t sequence,
              const v1::CreateRequest& request)
      : store_(store),
        link_(std::move(link)),
        token_(std::move(token)),
        sequence_(sequence),
        request_(request) {}

  Store::LaterCreate ForStore() { return {this, &request_, &response_}; }

  void Answer(absl::Status status, bool /*granted*/) override {
    v1::ChannelResponse reply;
    reply.set_sequence(sequence_);
    UniqueFd attached;
    if (status.ok()) {
      *reply.mutable_created() = std::move(response_);
      attached = store_.AttachNewSegmentLater(token_, reply.created().location(),
                                              reply.mutable_attached_segment());
      if (!attached.valid()) reply.clear_attached_segment();
    } else {
      Refuse(status, &reply);
    }
    (void)link_->Send(reply, attached.get());  // a client gone is no one's concern here
    delete this;
  }

 private:
  Store& store_;
  const std::shared_ptr<ChannelLink> link_;
  const std::string token_;
  const uint64_t sequence_;
  const v1::CreateRequest request_;
  v1::CreateResponse response_;
};

}  // namespace

ChannelReply HandleChannelRequest(Store& store, ChannelConnection& connection,
                                  const v1::ChannelRequest& request) {
  ChannelReply reply;
  reply.response.set_sequence(request.sequence());
  absl::StatusOr<UniqueFd> fd = store.Channel(
      connection.peer, &connection.session_token, request, &reply.response,
      [&] {
        auto* later = new LaterCreate(store, connection.link, connection.session_token,
                                      request.sequence(), request.create());
        return later->ForStore();
      },
      &reply.deferred);
  // A deferred create is counted when GrowPools answers it.
  if (reply.deferred) return reply;
  const absl::Status status = fd.status();
  if (fd.ok()) reply.fd = *std::move(fd);
  store.metrics().CountOp(ChannelRequestOp(request), status);
  if (!status.ok()) Refuse(status, &reply.response);
  return reply;
}

}  // namespace tensorshm
