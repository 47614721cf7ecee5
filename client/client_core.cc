#include "client/client_core.h"

#include <grpcpp/alarm.h>
#include <sys/mman.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tensor/grpc_status.h"

namespace tensorshm {
namespace {

constexpr char kSessionMetadataKey[] = "tensorshm-session";
// Largest number of ids sent in one release batch.
constexpr int kMaxBatch = 4096;
// Reconnecting: the pause between attempts.
constexpr absl::Duration kMinBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Seconds(2);

// Stocked buffers (CreateRequest.stock): per buffer length, the client asks for enough to hold
// kStockTargetBytes (between 1 and kMaxStockPerLength buffers), for lengths up to
// kMaxStockedLength, and holds at most kMaxStockBytes in all.
// A length is stocked once this client created kStockAfterCreates tensors of it: a
// producer in a loop, not a one-off.
constexpr uint64_t kStockAfterCreates = 8;
constexpr uint64_t kStockTargetBytes = 2 << 20;
constexpr uint64_t kMaxStockPerLength = 16;
constexpr uint64_t kMaxStockedLength = 4 << 20;
constexpr uint64_t kMaxStockBytes = 16 << 20;

// How often an idle sender looks at the channel's state.
constexpr absl::Duration kIdleCheck = absl::Milliseconds(100);
// How often a call waiting for a new session (CallAcrossRestart) has the sender try again.
constexpr absl::Duration kSessionPoll = absl::Milliseconds(100);

// Cancels a stream's context unless disarmed by a deadline: a daemon that accepted the
// connection but does not answer (stopped with SIGSTOP, hung) must not hold a session's opening
// forever, and a sync stream's reads take no deadline of their own. The timer is a gRPC alarm,
// run on gRPC's own threads: a thread of ours per opening would be one more thread to start in
// a forked child, where ThreadSanitizer cannot tell it from the parent's threads.
class OpenDeadline {
 public:
  OpenDeadline(grpc::ClientContext* context, absl::Time deadline) {
    if (deadline == absl::InfiniteFuture()) return;
    armed_ = true;
    alarm_.Set(absl::ToChronoTime(deadline), [this, context](bool expired) {
      MutexLock lock(&mu_);
      if (expired) {
        fired_ = true;
        context->TryCancel();
      }
      done_ = true;
      ran_.SignalAll();
    });
  }
  ~OpenDeadline() { Disarm(); }
  OpenDeadline(const OpenDeadline&) = delete;
  OpenDeadline& operator=(const OpenDeadline&) = delete;

  // Stops the timer and waits until its callback ran (cancelled, or fired): the callback uses
  // the context, which dies after this. True if it had fired (the context was cancelled).
  bool Disarm() {
    if (!armed_) return false;
    alarm_.Cancel();
    MutexLock lock(&mu_);
    while (!done_) ran_.Wait(&mu_);
    return fired_;
  }

 private:
  grpc::Alarm alarm_;
  bool armed_ = false;
  Mutex mu_;
  CondVar ran_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
};

// The lease id a page lease carries in held_ after a restart turned it into a reattached one,
// until the new daemon answers with the real id.
constexpr uint64_t kPageLeaseId = ~uint64_t{0};

}  // namespace

absl::Status ClientCore::Open(bool reattach, absl::Time deadline, CancelState* cancel) {
  // The session's stream runs on `connection`, so it is declared before the stream's context.
  std::shared_ptr<DaemonConnection> connection;
  if (reattach) {
    // A new connection, checked like the first: whoever serves the socket now may not be the
    // daemon that served it before.
    absl::StatusOr<std::shared_ptr<DaemonConnection>> made =
        DaemonConnection::Connect(socket_, server_uid_);
    if (!made.ok()) return made.status();
    connection = *std::move(made);
  } else {
    connection = this->connection();
  }
  auto context = std::make_unique<grpc::ClientContext>();
  v1::SessionRequest open;
  open.mutable_open()->set_client_version(TENSORSHM_VERSION);
  open.mutable_open()->set_pid(getpid());
  open.mutable_open()->set_client_name(client_name_);
  std::vector<uint64_t> keys;
  std::vector<uint64_t> unpublished_keys;
  if (reattach) {
    RetireFastPath();
    DropStock();
    MutexLock lock(&mu_);
    for (const auto& [key, held] : held_) {
      // A lease the last daemon already refused stays refused.
      if (held.lease_id == 0) continue;
      keys.push_back(key);
      open.mutable_open()->add_held_tensor_ids(held.tensor_id);
    }
    for (const auto& [key, tensor_id] : unpublished_) {
      unpublished_keys.push_back(key);
      open.mutable_open()->add_unpublished_tensor_ids(tensor_id);
    }
  }
  ScopedWait waiting(cancel, CancelState::Wait{context.get(), nullptr});
  if (!waiting.registered()) return absl::CancelledError("connect: the wait was cancelled");
  auto stream = connection->stub()->Session(context.get());
  v1::SessionResponse opened;
  OpenDeadline timer(context.get(), deadline);
  const bool answered = stream->Write(open) && stream->Read(&opened) && opened.has_opened();
  const bool timed_out = timer.Disarm();
  if (!answered) {
    stream->WritesDone();
    absl::Status status = FromGrpcStatus(stream->Finish());
    if (cancel != nullptr && cancel->cancelled()) {
      return absl::CancelledError(
          absl::StrCat("connect to tensorshmd at unix:", socket_, ": the wait was cancelled"));
    }
    if (timed_out) {
      return absl::UnavailableError(
          absl::StrCat("tensorshmd at unix:", socket_,
                       " accepted the connection but did not open a session "
                       "by the connect timeout (is the daemon stopped or hung?)"));
    }
    // A refusal (PERMISSION_DENIED, ...) keeps its code; a broken connection is UNAVAILABLE.
    const absl::StatusCode code = status.ok() || status.code() == absl::StatusCode::kCancelled ||
                                          status.code() == absl::StatusCode::kDeadlineExceeded
                                      ? absl::StatusCode::kUnavailable
                                      : status.code();
    return absl::Status(code, absl::StrCat("tensorshmd at unix:", socket_,
                                           " did not open a session: ", status.message()));
  }
  const v1::SessionOpened& answer = opened.opened();
  // Mappings of segments this daemon does not serve are not the same memory: they go (each
  // once no tensor of ours uses it). A recovered daemon lists the segments it took back under
  // the instance that made them, so those stay.
  std::set<SegmentKey> live;
  for (const v1::SegmentRef& segment : answer.segments()) {
    live.emplace(segment.segment_instance(), segment.segment_id());
  }
  segments_.Retain(live);
  {
    MutexLock lock(&mu_);
    session_id_ = answer.session_id();
    session_number_ = answer.session_number();
    daemon_instance_ = answer.instance_id();
    ++generation_;
    session_opened_.SignalAll();
    if (reattach) {
      // Batches numbered before now went to the old session, which will never acknowledge them
      // (one may have failed on the broken stream): Flush must not wait for them.
      acked_sequence_ = next_sequence_ - 1;
      acked_.SignalAll();
      // Leases and tensors the daemon did not take back are gone: their releases are dropped, and
      // Flush reports the loss (the memory is no longer reserved for them).
      std::vector<uint64_t> lost;
      for (size_t i = 0; i < keys.size(); ++i) {
        const uint64_t lease =
            static_cast<int>(i) < answer.lease_ids_size() ? answer.lease_ids(i) : 0;
        HeldLease& held = held_.at(keys[i]);
        held.lease_id = lease;
        if (lease == 0) lost.push_back(held.tensor_id);
      }
      for (size_t i = 0; i < unpublished_keys.size(); ++i) {
        if (static_cast<int>(i) >= answer.readopted_size() || !answer.readopted(i)) {
          lost.push_back(unpublished_.at(unpublished_keys[i]));
          unpublished_.erase(unpublished_keys[i]);
        }
      }
      // A loss outranks a refused release: it is what the caller must not miss.
      if (!lost.empty() && !absl::IsDataLoss(rejection_)) {
        rejection_ = absl::DataLossError(absl::StrCat(
            "tensorshmd at unix:", socket_, " restarted (instance ", answer.instance_id(),
            ") and did not take back ", lost.size(), " tensors this client held (tensor ids ",
            absl::StrJoin(lost, ", "),
            "): their memory is no longer reserved for them; acquire or create them again"));
      }
    }
    // The old stream (finished) goes before the context it was made with, and both before the
    // connection they ran on.
    stream_ = std::move(stream);
    session_context_ = std::move(context);
    connected_ = true;
    reconnect_error_ = absl::OkStatus();
    // The old connection goes with `connection` on return, outside the locks.
    MutexLock connection_lock(&connection_mu_);
    connection_.swap(connection);
  }
  SetUpFastPath();
  return absl::OkStatus();
}

std::optional<ClientCore::StockedBuffer> ClientCore::TakeStock(uint64_t length) {
  MutexLock lock(&stock_mu_);
  auto it = stock_.find(length);
  if (it == stock_.end() || it->second.empty()) return std::nullopt;
  StockedBuffer buffer = it->second.back();
  it->second.pop_back();
  stock_bytes_ -= length;
  return buffer;
}

uint32_t ClientCore::StockWanted(uint64_t length) const {
  if (length == 0 || length > kMaxStockedLength) return 0;
  const uint64_t target = std::clamp<uint64_t>(kStockTargetBytes / length, 1, kMaxStockPerLength);
  MutexLock lock(&stock_mu_);
  auto created = creates_.find(length);
  if (created == creates_.end() || created->second < kStockAfterCreates) return 0;
  auto it = stock_.find(length);
  const uint64_t have = it == stock_.end() ? 0 : it->second.size();
  // Refilled ahead of need: when half is gone.
  if (have * 2 > target || stock_bytes_ + (target - have) * length > kMaxStockBytes) return 0;
  return static_cast<uint32_t>(target - have);
}

void ClientCore::AddStock(const google::protobuf::RepeatedPtrField<v1::StockedBuffer>& stocked) {
  for (const v1::StockedBuffer& buffer : stocked) {
    // Populated on the sender thread: the publish or create that brought the stock does not
    // wait for it (CreateImpl populates whatever is left when it takes the buffer).
    absl::StatusOr<HostBuffer> mapped = MapHostBuffer(buffer.location(), /*populate=*/false);
    if (!mapped.ok()) continue;
    {
      MutexLock lock(&mu_);
      to_populate_.push_back(
          [segment = mapped->segment, offset = buffer.location().offset(),
           length = buffer.location().length()] { segment->Populate(offset, length); });
      work_.Signal();
    }
    MutexLock lock(&stock_mu_);
    stock_[buffer.location().length()].push_back(
        StockedBuffer{buffer.tensor_id(), *std::move(mapped), buffer.location()});
    stock_bytes_ += buffer.location().length();
  }
}

void ClientCore::ExpectFill(uint64_t length) {
  // A fill at a conservative 4 GB/s (a single-threaded copy from cold memory), plus what the
  // caller does around it; the daemon bounds the wait to 1 ms anyway.
  constexpr uint64_t kBytesPerMicro = 4096;
  constexpr uint64_t kAround = 100;
  memory_.Expect(session_id(), static_cast<uint32_t>(
                                   std::min<uint64_t>(length / kBytesPerMicro + kAround, 1000)));
}

void ClientCore::DropStock() {
  MutexLock lock(&stock_mu_);
  stock_.clear();
  stock_bytes_ = 0;
}

void ClientCore::SetUpFastPath() {
  const std::string token = session_id();
  absl::StatusOr<std::shared_ptr<FastPath>> fast = FastPath::Open(memory_, token);
  MutexLock lock(&mu_);
  // A session that ended meanwhile gets no fast path: the next one will.
  if (fast.ok() && session_id_ == token) fast_ = *std::move(fast);
}

void ClientCore::RetireFastPath() {
  std::shared_ptr<FastPath> old;
  {
    MutexLock lock(&mu_);
    old = std::move(fast_);
  }
  if (old == nullptr) return;
  const int converted = old->Retire([this](uint64_t tensor_id) {
    MutexLock lock(&mu_);
    const uint64_t key = next_key_++;
    held_.emplace(key, HeldLease{tensor_id, kPageLeaseId});
    ++outstanding_;
    return key;
  });
  page_leases_.fetch_sub(converted, std::memory_order_acq_rel);
}

void ClientCore::SweepReadyEvents() {
  // Only when enough events piled up: one look reads every record of the catalog, so at least
  // record_count / kRecordsPerSweptEvent events must be there to pay for it.
  constexpr size_t kRecordsPerSweptEvent = 256;
  if (cuda_.ready_event_count() < kMinReadyEventSweep) return;
  std::shared_ptr<FastPath> fast = fast_path();
  if (fast == nullptr) return;
  cuda_.SweepReadyEvents(fast->record_count() / kRecordsPerSweptEvent,
                         [&](std::vector<uint64_t>* ids) { fast->HeldTensorIds(ids); });
}

std::shared_ptr<FastPath> ClientCore::fast_path() const {
  MutexLock lock(&mu_);
  return fast_;
}

void ClientCore::ReleasePageLease(FastPath& fast, uint32_t page_slot) noexcept {
  uint64_t key = 0;
  if (!fast.Release(page_slot, &key)) {
    QueueRelease(key);
    return;
  }
  // The sender waits for the last lease of a closed client; only then is it worth a wake-up.
  if (page_leases_.fetch_sub(1, std::memory_order_acq_rel) == 1 &&
      closing_.load(std::memory_order_acquire)) {
    MutexLock lock(&mu_);
    work_.Signal();
  }
}

absl::Status ClientCore::PageLeaseStatus(const FastPath& fast, uint32_t page_slot) const {
  uint64_t key = 0;
  if (fast.ConvertedKey(page_slot, &key)) return LeaseStatus(key);
  return absl::OkStatus();
}

bool ClientCore::Reconnect() {
  absl::Duration backoff = kMinBackoff;
  while (true) {
    {
      MutexLock lock(&mu_);
      // What was queued for the dead session needs no sending: the daemon that held those
      // leases is gone, and they must not be re-registered.
      for (uint64_t key : pending_leases_) held_.erase(key);
      for (uint64_t key : pending_abandons_) unpublished_.erase(key);
      // Settled, as is the batch the broken stream lost: nothing is left to send for them.
      taken_releases_ += pending_leases_.size();
      taken_abandons_ += pending_abandons_.size();
      settled_releases_ = taken_releases_;
      settled_abandons_ = taken_abandons_;
      pending_leases_.clear();
      pending_abandons_.clear();
      pending_settles_.clear();  // the dead session's grants went with it
      if (SenderDone()) return false;
    }
    absl::Status opened = Open(/*reattach=*/true, absl::Now() + connect_timeout_, nullptr);
    if (opened.ok()) return true;
    MutexLock lock(&mu_);
    reconnect_error_ = opened;
    // A call waiting for the new session (WaitForSession) cuts the pause short.
    if (!SenderDone()) work_.WaitWithTimeout(&mu_, backoff);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

std::string ClientCore::PrepareContext(grpc::ClientContext& context, absl::Duration timeout) const {
  std::string session = session_id();
  context.AddMetadata(kSessionMetadataKey, session);
  if (timeout != absl::InfiniteDuration()) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  return session;
}

void ClientCore::QueueSettle(const std::string& session, uint64_t request_id) noexcept {
  MutexLock lock(&mu_);
  if (session != session_id_) return;  // that session ended, and its grants with it
  pending_settles_.push_back(request_id);
  work_.Signal();
}

bool ClientCore::SessionEnded(uint64_t generation, bool look) const {
  {
    MutexLock lock(&mu_);
    if (generation_ != generation || !connected_) return true;
  }
  return look && connection()->Broken();
}

bool ClientCore::WaitForSession(uint64_t generation, absl::Time deadline,
                                const CancelState* cancel) {
  MutexLock lock(&mu_);
  while (generation_ == generation) {
    const absl::Time now = absl::Now();
    if (now >= deadline || (cancel != nullptr && cancel->cancelled()) || client_closed_) {
      return false;
    }
    // A live stream is probed with an empty batch (the daemon may be stopping without having
    // hung up yet); a broken one is reconnected now rather than after the backoff.
    if (connected_) flush_requested_ = true;
    work_.Signal();
    session_opened_.WaitWithTimeout(&mu_, std::min(kSessionPoll, deadline - now));
  }
  return true;
}

absl::Status ClientCore::NoSession(std::string_view what) const {
  MutexLock lock(&mu_);
  return absl::UnavailableError(absl::StrCat(
      absl::string_view(what.data(), what.size()), ": the session with tensorshmd at unix:",
      socket_, " ended and no new one opened before the call's deadline (is the daemon running?)",
      reconnect_error_.ok() ? ""
                            : absl::StrCat(" (last attempt: ", reconnect_error_.message(), ")")));
}

std::string ClientCore::session_id() const {
  MutexLock lock(&mu_);
  return session_id_;
}

uint64_t ClientCore::session_number() const {
  MutexLock lock(&mu_);
  return session_number_;
}

uint64_t ClientCore::daemon_instance() const {
  MutexLock lock(&mu_);
  return daemon_instance_;
}

absl::Status ClientCore::CheckProcess() const {
  if (!forked()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this tensorshm client was connected in process ", pid_, "; process ", getpid(),
      " is a fork of it and may not use its connection, session or leases: connect again in "
      "this process"));
}

absl::StatusOr<std::shared_ptr<const SegmentMapping>> ClientCore::MapHostSegment(
    const SegmentKey& key, uint64_t segment_size, uint64_t offset, uint64_t length) {
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> found = segments_.Find(key, segment_size);
  if (!found.ok() || *found != nullptr) return found;
  uint64_t size = 0;
  absl::StatusOr<int> fd =
      memory_.RequestSegment(session_id(), key.first, key.second, /*writable=*/false, &size);
  if (!fd.ok()) return fd.status();
  if (size < segment_size) {
    close(*fd);
    return absl::InternalError(absl::StrCat("tensorshmd granted ", SegmentLabel(key), " as ", size,
                                            " bytes; its location said ", segment_size));
  }
  // The whole segment, as the daemon granted it (at least what the caller needs).
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping =
      segments_.Insert(key, *fd, size, offset, length);
  if (mapping.ok() && (*mapping)->size() > length) {
    // The rest of the segment on the sender thread: a small first tensor does not wait for a
    // large segment, and later reads of it do not fault.
    MutexLock lock(&mu_);
    to_populate_.push_back([mapping = *mapping] { mapping->Populate(); });
    work_.Signal();
  }
  return mapping;
}

absl::StatusOr<ClientCore::HostBuffer> ClientCore::MapHostBuffer(const v1::Location& location,
                                                                 bool populate) {
  const SegmentKey key{location.segment_instance(), location.segment_id()};
  std::shared_ptr<WritableSegment> segment = segments_.FindWritable(key);
  if (segment == nullptr) {
    uint64_t size = 0;
    absl::StatusOr<int> fd =
        memory_.RequestSegment(session_id(), key.first, key.second, /*writable=*/true, &size);
    if (!fd.ok()) return fd.status();
    absl::StatusOr<std::shared_ptr<WritableSegment>> inserted =
        segments_.InsertWritable(key, *fd, size);
    if (!inserted.ok()) return inserted.status();
    segment = *std::move(inserted);
  }
  absl::StatusOr<char*> data = segment->Prepare(location.offset(), location.length(), populate);
  if (!data.ok()) return data.status();
  return HostBuffer{std::move(segment), *data};
}

uint64_t ClientCore::AddLease(uint64_t tensor_id, uint64_t lease_id) {
  MutexLock lock(&mu_);
  const uint64_t key = next_key_++;
  held_.emplace(key, HeldLease{tensor_id, lease_id});
  ++outstanding_;
  return key;
}

uint64_t ClientCore::AddUnpublished(uint64_t tensor_id) {
  MutexLock lock(&mu_);
  const uint64_t key = next_key_++;
  unpublished_.emplace(key, tensor_id);
  ++outstanding_;
  return key;
}

absl::StatusOr<uint64_t> ClientCore::UnpublishedId(uint64_t key) const {
  MutexLock lock(&mu_);
  auto it = unpublished_.find(key);
  if (it == unpublished_.end()) {
    return absl::DataLossError(
        absl::StrCat("this writable tensor was lost when tensorshmd at unix:", socket_,
                     " restarted (not taken back in its --recovery-grace); create it again"));
  }
  return it->second;
}

void ClientCore::Published(uint64_t key) {
  MutexLock lock(&mu_);
  unpublished_.erase(key);
  --outstanding_;
  // Nothing to send: only a closed client's sender waits for this (a wake-up per publish would
  // cost a context switch on the hot path).
  if (client_closed_) work_.Signal();
}

absl::Status ClientCore::LeaseStatus(uint64_t key) const {
  MutexLock lock(&mu_);
  auto it = held_.find(key);
  if (it != held_.end() && it->second.lease_id != 0) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      it == held_.end() ? std::string("this tensor")
                        : absl::StrCat("tensor ", it->second.tensor_id),
      ": tensorshmd at unix:", socket_,
      " restarted and did not take its lease back; the memory is no longer reserved for it"));
}

void ClientCore::QueueRelease(uint64_t key) noexcept {
  MutexLock lock(&mu_);
  pending_leases_.push_back(key);
  ++queued_releases_;
  --outstanding_;
  work_.Signal();
}

void ClientCore::QueueAbandon(uint64_t key) noexcept {
  MutexLock lock(&mu_);
  pending_abandons_.push_back(key);
  ++queued_abandons_;
  --outstanding_;
  work_.Signal();
}

bool ClientCore::CloseClient() {
  MutexLock lock(&mu_);
  client_closed_ = true;
  closing_.store(true, std::memory_order_release);
  work_.Signal();
  return outstanding_ == 0 && page_leases_.load(std::memory_order_acquire) == 0;
}

absl::Status ClientCore::Flush() {
  MutexLock lock(&mu_);
  // Always a round trip: page leases were given back by a store the daemon has not seen yet,
  // and an empty batch makes it look (and free what they held). Then as many more as it takes
  // to send everything queued before now: a batch holds at most kMaxBatch ids of each kind, and
  // the sender keeps sending while the queues are not empty.
  const uint64_t target = next_sequence_;
  const uint64_t releases = queued_releases_;
  const uint64_t abandons = queued_abandons_;
  flush_requested_ = true;
  work_.Signal();
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return acked_sequence_ >= target && settled_releases_ >= releases &&
           settled_abandons_ >= abandons;
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

bool ClientCore::TakeBatch(v1::ReleaseBatch* batch) {
  size_t taken = 0;
  for (; taken < pending_leases_.size() && batch->lease_ids_size() < kMaxBatch; ++taken) {
    auto it = held_.find(pending_leases_[taken]);
    if (it == held_.end()) continue;
    if (it->second.lease_id != 0) batch->add_lease_ids(it->second.lease_id);
    held_.erase(it);
  }
  pending_leases_.erase(pending_leases_.begin(), pending_leases_.begin() + taken);
  taken_releases_ += taken;
  taken = 0;
  for (; taken < pending_abandons_.size() && batch->abandoned_tensor_ids_size() < kMaxBatch;
       ++taken) {
    auto it = unpublished_.find(pending_abandons_[taken]);
    if (it == unpublished_.end()) continue;
    batch->add_abandoned_tensor_ids(it->second);
    unpublished_.erase(it);
  }
  pending_abandons_.erase(pending_abandons_.begin(), pending_abandons_.begin() + taken);
  taken_abandons_ += taken;
  taken = std::min<size_t>(pending_settles_.size(), kMaxBatch);
  batch->mutable_settled_request_ids()->Add(pending_settles_.begin(),
                                            pending_settles_.begin() + taken);
  pending_settles_.erase(pending_settles_.begin(), pending_settles_.begin() + taken);
  return batch->lease_ids_size() > 0 || batch->abandoned_tensor_ids_size() > 0 ||
         batch->settled_request_ids_size() > 0;
}

void ClientCore::SendReleases(std::shared_ptr<ClientCore> self) {
  while (true) {
    v1::SessionRequest request;
    uint64_t sequence = 0;
    std::vector<std::function<void()>> populate;
    {
      MutexLock lock(&mu_);
      bool probe = false;
      while (connected_ && pending_leases_.empty() && pending_abandons_.empty() &&
             pending_settles_.empty() && to_populate_.empty() && !flush_requested_ &&
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
        if (!TakeBatch(request.mutable_release()) && !probe && !flush) {
          // Only ids the daemon no longer knows: nothing to send.
          acked_sequence_ = sequence;
          settled_releases_ = taken_releases_;
          settled_abandons_ = taken_abandons_;
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
    v1::SessionResponse response;
    const bool ok = stream_->Write(request) && stream_->Read(&response) && response.has_ack();
    if (!ok) {
      stream_->WritesDone();
      stream_->Finish().ok();
    }
    MutexLock lock(&mu_);
    if (!ok) {
      // The daemon is gone and with it every lease this batch released; Flush callers learn
      // that the session ended.
      connected_ = false;
      acked_.SignalAll();
      continue;
    }
    for (const v1::Rejection& r : response.ack().rejected()) {
      if (rejection_.ok()) {
        rejection_ = absl::Status(static_cast<absl::StatusCode>(r.code()), r.message());
      }
    }
    acked_sequence_ = sequence;
    // One batch is in flight at a time: what was taken is what this ack settles.
    settled_releases_ = taken_releases_;
    settled_abandons_ = taken_abandons_;
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
