#include "server/rpc/channel_handler.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/functional/function_ref.h"
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
    case v1::ChannelRequest::kAcquire:
      return MetricOp::kAcquire;
    case v1::ChannelRequest::kRelease:
      return MetricOp::kRelease;
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

// What a channel request answered later shares: the link it is answered through (which holds it
// until then), its sequence, and whether the client gave up on it (its connection's close, or a
// ChannelCancel naming it).
class LaterAnswer : public DeferredCall {
 public:
  // Given up on before the Store has it (which then does not let it wait).
  void GiveUpUnqueued() { given_up_.store(true, std::memory_order_release); }

 protected:
  LaterAnswer(std::shared_ptr<ChannelLink> link, uint64_t sequence, absl::Duration hold)
      : link_(std::move(link)), sequence_(sequence), hold_(hold) {}

  bool given_up() const { return given_up_.load(std::memory_order_acquire); }
  void MarkGivenUp() { given_up_.store(true, std::memory_order_release); }

  // Sends `reply` (with descriptor `fd`), tells the Store whether it was sent (`done`), and drops
  // the link's hold on this call (last: that may free it). Under the test hook (a hold, and a
  // `granted` answer) the Store is told now, as sent, and the answer leaves `hold_` later on a
  // thread of its own, which touches only the link and `self` (both shared): under the hook only
  // the client's settle gives a crossed grant back.
  void Deliver(std::shared_ptr<LaterAnswer> self, v1::ChannelResponse reply, UniqueFd fd,
               bool granted, absl::FunctionRef<void(bool sent)> done) {
    reply.set_sequence(sequence_);
    if (granted && hold_ > absl::ZeroDuration()) {
      done(true);
      std::thread([self = std::move(self), reply = std::move(reply), fd = std::move(fd)]() {
        absl::SleepFor(self->hold_);
        self->link_->Send(reply, fd.get());
        self->link_->Drop(self->sequence_);
      }).detach();
      return;
    }
    // Not sent (the client is gone): what the answer granted is given back.
    done(link_->Send(reply, fd.get()));
    link_->Drop(sequence_);
  }

 private:
  const std::shared_ptr<ChannelLink> link_;
  const uint64_t sequence_;
  const absl::Duration hold_;  // StoreTestHooks::cross_cancel_hold
  std::atomic<bool> given_up_{false};
};

// A wait's deadline from its wait_ms: 0 is at once (a create that waits only for its pool to
// grow: still short of memory once grown, it is refused), -1 never.
absl::Time DeadlineOf(absl::Time start, int64_t wait_ms) {
  if (wait_ms < 0) return absl::InfiniteFuture();
  return start + absl::Milliseconds(wait_ms);
}

// A channel create that waits (for its pool to grow, or for memory). Its answer brings the
// segment the buffer lies in when the session had not been granted it.
class ChannelCreateWait final : public CreateWait,
                                public LaterAnswer,
                                public std::enable_shared_from_this<ChannelCreateWait> {
 public:
  ChannelCreateWait(Store& store, std::shared_ptr<ChannelLink> link, std::string token,
                    uint64_t sequence, CreateOrder order, absl::Duration hold)
      : CreateWait(std::move(order)),
        LaterAnswer(std::move(link), sequence, hold),
        store_(store),
        token_(std::move(token)) {
    deadline = DeadlineOf(started, this->order.wait_ms);
  }

  bool Cancelled() const override { return given_up(); }
  void GiveUp() override {
    MarkGivenUp();
    store_.CancelCreate(this);  // a no-op unless it waits for memory now
  }

  void Answer(absl::Status status, bool granted) override {
    v1::ChannelResponse reply;
    UniqueFd attached;
    if (status.ok()) {
      ChannelCreated answer{.created = created};
      attached = store_.AttachLater(token_, answer.created.place, &answer.attached);
      ToWire(ChannelAnswer(std::move(answer)), &reply);
    } else {
      Refuse(status, &reply);
    }
    Deliver(shared_from_this(), std::move(reply), std::move(attached), granted,
            [this](bool sent) { store_.CreateWaiterDone(this, /*cancelled=*/!sent); });
  }

 private:
  Store& store_;
  const std::string token_;
};

// A channel acquire that waits for a publish.
class ChannelAcquireWait final : public AcquireWait,
                                 public LaterAnswer,
                                 public std::enable_shared_from_this<ChannelAcquireWait> {
 public:
  ChannelAcquireWait(Store& store, std::shared_ptr<ChannelLink> link, uint64_t sequence,
                     AcquireOrder order, absl::Duration hold)
      : AcquireWait(std::move(order)), LaterAnswer(std::move(link), sequence, hold), store_(store) {
    deadline = DeadlineOf(absl::Now(), wait_ms);
  }

  bool Cancelled() const override { return given_up(); }
  void GiveUp() override {
    MarkGivenUp();
    store_.CancelWaiter(this);
  }

  void Answer(absl::Status status, bool carries_grant) override {
    v1::ChannelResponse reply;
    if (status.ok()) {
      ToWire(ChannelAnswer(granted), &reply);
    } else {
      Refuse(status, &reply);
    }
    Deliver(shared_from_this(), std::move(reply), UniqueFd(), carries_grant,
            [this](bool sent) { store_.WaiterDone(this, /*cancelled=*/!sent); });
  }

 private:
  Store& store_;
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
  const bool may_wait = request.kind_case() == v1::ChannelRequest::kCreate ||
                        request.kind_case() == v1::ChannelRequest::kAcquire;
  if (may_wait && connection.link->Find(request.sequence()) != nullptr) {
    const absl::Status refused = absl::InvalidArgumentError(
        absl::StrCat("sequence = ", request.sequence(),
                     ": a request of this connection with that sequence still waits"));
    store.metrics().CountOp(ChannelRequestOp(request), refused);
    Refuse(refused, &reply.response);
    return reply;
  }
  // Made only for a request that may wait; held by the link before the Store can answer it (its
  // Answer drops it). Not held only once the connection is closed, which this thread does after
  // serving it.
  std::shared_ptr<LaterAnswer> later;
  auto hold = [&](std::shared_ptr<LaterAnswer> call) {
    later = std::move(call);
    if (!connection.link->Hold(request.sequence(), later)) later->GiveUpUnqueued();
  };
  const absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<ChannelAsk> ask = FromWire(request);
    if (!ask.ok()) return ask.status();
    // Named: a FunctionRef refers to its callable, which must outlive `waiters`.
    auto create = [&]() -> CreateWait* {
      auto waiting = std::make_shared<ChannelCreateWait>(
          store, connection.link, connection.session_token, request.sequence(),
          std::get<CreateOrder>(*ask), cross_cancel_hold);
      hold(waiting);
      return waiting.get();
    };
    auto acquire = [&]() -> AcquireWait* {
      auto waiting =
          std::make_shared<ChannelAcquireWait>(store, connection.link, request.sequence(),
                                               std::get<AcquireOrder>(*ask), cross_cancel_hold);
      hold(waiting);
      return waiting.get();
    };
    const ChannelWaiters waiters{.create = create, .acquire = acquire};
    absl::StatusOr<ChannelReplied> replied =
        store.Channel(connection.peer, &connection.session_token, *ask, waiters, &reply.deferred);
    if (!replied.ok()) return replied.status();
    if (reply.deferred) return absl::OkStatus();
    ToWire(replied->answer, &reply.response);
    reply.fd = std::move(replied->fd);
    return absl::OkStatus();
  }();
  if (reply.deferred) return reply;  // counted when it is answered
  if (later != nullptr) connection.link->Drop(request.sequence());
  store.metrics().CountOp(ChannelRequestOp(request), status);
  if (!status.ok()) Refuse(status, &reply.response);
  const uint64_t request_id = request.kind_case() == v1::ChannelRequest::kAcquire
                                  ? request.acquire().request_id()
                                  : request.create().request_id();
  if (cross_cancel_hold > absl::ZeroDuration() && status.ok() && may_wait && request_id != 0) {
    // Test only, as a granting answer given later: it leaves `cross_cancel_hold` later, on a
    // thread of its own that touches only the (shared) link.
    std::thread([link = connection.link, response = std::move(reply.response),
                 fd = std::move(reply.fd), hold = cross_cancel_hold]() {
      absl::SleepFor(hold);
      link->Send(response, fd.get());
    }).detach();
    reply.deferred = true;
  }
  return reply;
}

}  // namespace tensorshm
