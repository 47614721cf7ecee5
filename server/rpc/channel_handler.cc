#include "server/rpc/channel_handler.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

namespace {

// Fills `response`'s refusal from `status`.
void Refuse(const absl::Status& status, v1::ChannelResponse* response) {
  response->clear_kind();
  response->set_code(static_cast<int32_t>(status.code()));
  response->set_message(std::string(status.message()));
}

// A channel create that waits (for its pool to grow, or for memory), held by its connection's link
// until the Store answers it; the answer goes out through the link, with the segment the buffer
// lies in when the session had not been granted it. The connection's close or a ChannelCancel
// gives up on it.
class ChannelCreateWait final : public CreateWait,
                                public DeferredCall,
                                public std::enable_shared_from_this<ChannelCreateWait> {
 public:
  ChannelCreateWait(Store& store, std::shared_ptr<ChannelLink> link, std::string token,
                    uint64_t sequence, CreateOrder order, absl::Duration hold)
      : CreateWait(std::move(order)),
        store_(store),
        link_(std::move(link)),
        token_(std::move(token)),
        sequence_(sequence),
        hold_(hold) {
    const int64_t wait_ms = this->order.wait_ms;
    // A create that does not wait for memory (it waits only for its pool to grow) is past its
    // deadline at once: still short of memory once grown, it is refused.
    deadline = wait_ms < 0   ? absl::InfiniteFuture()
               : wait_ms > 0 ? started + absl::Milliseconds(wait_ms)
                             : started;
  }

  bool Cancelled() const override { return given_up_.load(std::memory_order_acquire); }

  void GiveUp() override {
    given_up_.store(true, std::memory_order_release);
    store_.CancelCreate(this);  // no-op unless it waits for memory now
  }
  // Given up on before the Store has it (which then refuses to queue it).
  void GiveUpUnqueued() { given_up_.store(true, std::memory_order_release); }

  void Answer(absl::Status status, bool granted) override {
    v1::ChannelResponse reply;
    reply.set_sequence(sequence_);
    UniqueFd attached;
    if (status.ok()) {
      ChannelCreated answer{.created = created};
      attached = store_.AttachLater(token_, answer.created.place, &answer.attached);
      ToWire(ChannelAnswer(std::move(answer)), &reply);
    } else {
      Refuse(status, &reply);
    }
    if (granted && hold_ > absl::ZeroDuration()) {
      // Test only: the answer leaves later, on a thread of its own, which touches only the link
      // and this call (both shared). Under the hook only the client's settle gives a crossed
      // grant back (CreateQueue::Done), so the Store is done with this call now.
      store_.CreateWaiterDone(this, /*cancelled=*/false);
      std::thread([self = shared_from_this(), reply = std::move(reply),
                   attached = std::move(attached)]() {
        absl::SleepFor(self->hold_);
        self->link_->Send(reply, attached.get());
        self->link_->Drop(self->sequence_);
      }).detach();
      return;
    }
    const bool sent = link_->Send(reply, attached.get());
    // Not sent (the client is gone): a create made all the same gives its buffers back.
    store_.CreateWaiterDone(this, /*cancelled=*/!sent);
    link_->Drop(sequence_);  // last: it may free this
  }

 private:
  Store& store_;
  const std::shared_ptr<ChannelLink> link_;
  const std::string token_;
  const uint64_t sequence_;
  const absl::Duration hold_;  // StoreTestHooks::cross_cancel_hold
  std::atomic<bool> given_up_{false};
};

}  // namespace

ChannelReply HandleChannelRequest(Store& store, ChannelConnection& connection,
                                  const v1::ChannelRequest& request,
                                  absl::Duration cross_cancel_hold) {
  ChannelReply reply;
  if (request.kind_case() == v1::ChannelRequest::kCancel) {
    // Answered by nothing; the request it names is answered CANCELLED (if it still waits).
    reply.deferred = true;
    if (std::shared_ptr<DeferredCall> call = connection.link->Find(request.cancel().sequence())) {
      call->GiveUp();
    }
    return reply;
  }
  reply.response.set_sequence(request.sequence());
  if (request.kind_case() == v1::ChannelRequest::kCreate &&
      connection.link->Find(request.sequence()) != nullptr) {
    const absl::Status refused = absl::InvalidArgumentError(
        absl::StrCat("sequence = ", request.sequence(),
                     ": a create of this connection with that sequence still waits"));
    store.metrics().CountOp(MetricOp::kCreate, refused);
    Refuse(refused, &reply.response);
    return reply;
  }
  std::shared_ptr<ChannelCreateWait> waiting;  // made only for a create that waits
  const absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<ChannelAsk> ask = FromWire(request);
    if (!ask.ok()) return ask.status();
    absl::StatusOr<ChannelReplied> replied = store.Channel(
        connection.peer, &connection.session_token, *ask,
        [&]() -> CreateWait* {
          waiting = std::make_shared<ChannelCreateWait>(
              store, connection.link, connection.session_token, request.sequence(),
              std::get<CreateOrder>(*ask), cross_cancel_hold);
          // Held before the Store can answer it (its Answer drops it). Not held only once the
          // connection is closed, which this thread does after serving it.
          if (!connection.link->Hold(request.sequence(), waiting)) waiting->GiveUpUnqueued();
          return waiting.get();
        },
        &reply.deferred);
    if (!replied.ok()) return replied.status();
    if (reply.deferred) return absl::OkStatus();
    ToWire(replied->answer, &reply.response);
    reply.fd = std::move(replied->fd);
    return absl::OkStatus();
  }();
  if (reply.deferred) return reply;  // counted when it is answered
  if (waiting != nullptr) connection.link->Drop(request.sequence());
  store.metrics().CountOp(ChannelRequestOp(request), status);
  if (!status.ok()) Refuse(status, &reply.response);
  return reply;
}

}  // namespace tensorshm
