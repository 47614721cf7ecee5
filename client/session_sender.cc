// ClientCore's sender thread: batches of releases on the session stream, and reconnecting after
// the stream broke.
#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client_core.h"
#include "client/fork.h"

namespace tensorshm {
namespace {

// Largest number of ids sent in one release batch.
constexpr int kMaxBatch = 4096;
// Reconnecting: the pause between attempts.
constexpr absl::Duration kMinBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Seconds(2);

// How often an idle sender looks at the channel's state.
constexpr absl::Duration kIdleCheck = absl::Milliseconds(100);

}  // namespace

bool ClientCore::Reconnect() {
  absl::Duration backoff = kMinBackoff;
  while (true) {
    {
      MutexLock lock(&mu_);
      // What was queued for the dead session needs no sending: the daemon that held those
      // leases is gone, and they must not be re-registered.
      holdings_.DropQueued();
      if (SenderDone()) return false;
    }
    absl::Status opened = Open(/*reattach=*/true, absl::Now() + connect_timeout_, nullptr);
    if (opened.ok()) return true;
    MutexLock lock(&mu_);
    reconnect_error_ = opened;
    ++failed_reconnects_;
    session_opened_.SignalAll();  // a call waiting for the session hears of a refusal at once
    // A call waiting for the new session (WaitForSession) cuts the pause short.
    if (!SenderDone()) work_.WaitWithTimeout(&mu_, backoff);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

bool ClientCore::CloseClient() {
  MutexLock lock(&mu_);
  client_closed_ = true;
  closing_.store(true, std::memory_order_release);
  work_.Signal();
  return holdings_.outstanding() == 0 && page_leases_.load(std::memory_order_acquire) == 0;
}

absl::Status ClientCore::Flush() {
  MutexLock lock(&mu_);
  // Always a round trip: page leases were given back by a store the daemon has not seen yet,
  // and an empty batch makes it look (and free what they held). Then as many more as it takes
  // to send everything queued before now: a batch holds at most kMaxBatch ids of each kind, and
  // the sender keeps sending while the queues are not empty.
  const uint64_t target = next_sequence_;
  const Holdings::Mark queued = holdings_.Queued();
  flush_requested_ = true;
  work_.Signal();
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return acked_sequence_ >= target && holdings_.SettledUpTo(queued);
  };
  while (!done() && connected_) acked_.Wait(&mu_);
  if (!done()) {
    return absl::UnavailableError(absl::StrCat(
        "session with tensorshmd at unix:", socket_, " ended; reconnecting",
        reconnect_error_.ok() ? ""
                              : absl::StrCat(" (last attempt: ", reconnect_error_.message(), ")")));
  }
  absl::Status result = rejection_;
  rejection_ = absl::OkStatus();
  return result;
}

bool ClientCore::SendBatch(v1::SessionRequest& request, v1::ReleaseAck* ack) {
  // Over the memory channel, as every data-plane call; on the session stream only when the
  // channel cannot be had.
  v1::ChannelRequest call;
  *call.mutable_release() = std::move(*request.mutable_release());
  UniqueFd unexpected;  // a release's answer brings none
  absl::StatusOr<v1::ChannelResponse> answer = memory_.Exchange(session_id(), call, &unexpected);
  if (answer.ok() && answer->has_ack()) {
    *ack = std::move(*answer->mutable_ack());
    return true;
  }
  if (!ChannelNotHad(answer.status())) {
    // The daemon is gone or the session ended (its answer, or none): as a broken stream.
    stream_->WritesDone();
    stream_->Finish().ok();
    return false;
  }
  *request.mutable_release() = std::move(*call.mutable_release());
  v1::SessionResponse response;
  if (stream_->Write(request) && stream_->Read(&response) && response.has_ack()) {
    *ack = std::move(*response.mutable_ack());
    return true;
  }
  stream_->WritesDone();
  stream_->Finish().ok();
  return false;
}

void ClientCore::SendReleases(std::shared_ptr<ClientCore> self) {
  while (true) {
    v1::SessionRequest request;
    uint64_t sequence = 0;
    std::vector<std::function<void()>> populate;
    {
      MutexLock lock(&mu_);
      bool probe = false;
      while (connected_ && !holdings_.HasQueued() && to_populate_.empty() && !flush_requested_ &&
             !SenderDone()) {
        // The sync stream says nothing until used, so a daemon gone while this client is idle
        // shows as its connection hung up, or sooner as the index's heartbeat going stale: an
        // empty batch then tells whether the stream lives.
        if (work_.WaitWithTimeout(&mu_, kIdleCheck) &&
            (connection()->Broken() || (fast_ != nullptr && !fast_->DaemonServing()))) {
          probe = true;
          break;
        }
      }
      if (SenderDone()) break;
      if (!to_populate_.empty()) {
        populate.swap(to_populate_);
      } else if (connected_) {
        sequence = next_sequence_++;
        request.mutable_release()->set_sequence(sequence);
        const bool flush = flush_requested_;
        flush_requested_ = false;
        if (!holdings_.TakeBatch(request.mutable_release(), kMaxBatch) && !probe && !flush) {
          // Only ids the daemon no longer knows: nothing to send.
          acked_sequence_ = sequence;
          holdings_.SettleTaken();
          acked_.SignalAll();
          continue;
        }
      }
    }
    if (!populate.empty()) {
      for (const std::function<void()>& job : populate) job();
      continue;
    }
    if (!request.has_release()) {
      if (!Reconnect()) break;
      continue;
    }
    v1::ReleaseAck ack;
    const bool ok = SendBatch(request, &ack);
    MutexLock lock(&mu_);
    if (!ok) {
      // The daemon is gone and with it every lease this batch released; Flush callers learn
      // that the session ended.
      connected_ = false;
      acked_.SignalAll();
      continue;
    }
    for (const v1::Rejection& r : ack.rejected()) {
      if (rejection_.ok()) {
        rejection_ = absl::Status(static_cast<absl::StatusCode>(r.code()), r.message());
      }
    }
    acked_sequence_ = sequence;
    // One batch is in flight at a time: what was taken is what this ack settles.
    holdings_.SettleTaken();
    acked_.SignalAll();
  }
  // Tensors released while the process exits (Python's finalization) end a detached sender in
  // the middle of exit(): gRPC must then be left alone (see BeginSenderTeardown).
  if (!BeginSenderTeardown()) {
    KeepForever(std::move(self));
    return;
  }
  bool connected;
  {
    MutexLock lock(&mu_);
    connected = connected_;
  }
  if (connected) {
    stream_->WritesDone();
    stream_->Finish().ok();
  }
  // `self` kept the core alive while tensors outlived the Client; it goes here, possibly last.
  self.reset();
  EndSenderTeardown();
}

}  // namespace tensorshm
