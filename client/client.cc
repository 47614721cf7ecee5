#include "tensorshm/client.h"

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cuda_state.h"
#include "client/fast_path.h"
#include "client/fork.h"
#include "client/memory_channel.h"
#include "client/segment_map.h"
#include "common/grpc_status.h"
#include "common/layout.h"
#include "common/mutex.h"
#include "common/name.h"
#include "common/socket_path.h"
#include "common/wire.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {
namespace {

constexpr char kSessionMetadataKey[] = "tensorshm-session";
// Deadline of unary calls that do not wait for anything.
constexpr absl::Duration kCallTimeout = absl::Seconds(60);
// Largest number of ids sent in one release batch.
constexpr int kMaxBatch = 4096;
// Reconnecting: how long one attempt waits for the daemon, and the pause between attempts.
constexpr absl::Duration kReconnectWait = absl::Seconds(1);
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

// absl here predates its use of std::string_view, so names cross over explicitly.
absl::string_view View(std::string_view text) {
  return absl::string_view(text.data(), text.size());
}

// The lease id a page lease carries in held_ after a restart turned it into a reattached one,
// until the new daemon answers with the real id.
constexpr uint64_t kPageLeaseId = ~uint64_t{0};

// Data pointer of empty tensors: non-null and 256-byte aligned, never read.
alignas(256) const char kEmptyData[256] = {};

}  // namespace

// Everything a Client and its tensors share: the channel, the session stream, the release queue
// and the segment mappings. Lives as long as the Client or any tensor from it. Thread-safe.
//
// When the session stream breaks (the daemon died or restarted), the sender thread reconnects
// with backoff and re-registers what the client still holds: the tensors of its live leases and
// its unpublished writable tensors. A restarted daemon honours that within its grace period and
// answers with new lease ids, which replace the old ones behind the client-side lease keys.
class ClientCore {
 public:
  ClientCore(std::string socket, std::shared_ptr<grpc::Channel> channel, std::string client_name)
      : socket_(std::move(socket)),
        client_name_(std::move(client_name)),
        fork_generation_(ForkGeneration()),
        pid_(getpid()),
        channel_(std::move(channel)),
        stub_(v1::TensorShm::NewStub(channel_)),
        memory_(socket_) {}
  ~ClientCore() { DropStock(); }

  // True in a child process fork() made after this core: nothing of it may be used there.
  bool forked() const { return ForkGeneration() != fork_generation_; }
  // OK in the process that connected; FAILED_PRECONDITION naming both pids in a forked child.
  absl::Status CheckProcess() const;

  // Opens the first session. A refusal keeps its code; no daemon is UNAVAILABLE.
  absl::Status OpenSession() { return Open(/*reattach=*/false); }

  // Registers a lease the daemon granted on `tensor_id`; returns the client-side key that
  // QueueRelease takes. Each lease is "outstanding" until released.
  uint64_t AddLease(uint64_t tensor_id, uint64_t lease_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Registers an unpublished writable tensor (outstanding until published or abandoned); returns
  // the client-side key that the other calls take.
  uint64_t AddUnpublished(uint64_t tensor_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon's id of unpublished tensor `key`; DATA_LOSS if a restarted daemon did not take it
  // back (its id may name another tensor now).
  absl::StatusOr<uint64_t> UnpublishedId(uint64_t key) const ABSL_LOCKS_EXCLUDED(mu_);
  void Published(uint64_t key) ABSL_LOCKS_EXCLUDED(mu_);
  // Queue a lease release / an abandoned writable tensor for the sender thread. O(1), never
  // blocks on I/O.
  void QueueRelease(uint64_t key) noexcept ABSL_LOCKS_EXCLUDED(mu_);
  void QueueAbandon(uint64_t key) noexcept ABSL_LOCKS_EXCLUDED(mu_);
  // OK while the daemon holds lease `key` for this client; DATA_LOSS once a restarted daemon did
  // not take it back.
  absl::Status LeaseStatus(uint64_t key) const ABSL_LOCKS_EXCLUDED(mu_);

  // The session's fast path, or nullptr (not set up, or the daemon does not offer one).
  std::shared_ptr<FastPath> fast_path() const ABSL_LOCKS_EXCLUDED(mu_);
  // A lease slot of `fast` was taken / is given back (its tensor's deleter). The slot is
  // cleared with one store; once `fast` was retired, the lease it was turned into is released.
  void PageLeaseTaken() { page_leases_.fetch_add(1, std::memory_order_relaxed); }
  void ReleasePageLease(FastPath& fast, uint32_t page_slot) noexcept ABSL_LOCKS_EXCLUDED(mu_);
  // LeaseStatus of a page lease.
  absl::Status PageLeaseStatus(const FastPath& fast, uint32_t page_slot) const;
  // A memory channel request for the current session (Create, Publish); UNAVAILABLE when the
  // channel cannot be had (the caller then uses the RPC), else the daemon's answer.
  absl::StatusOr<v1::ChannelResponse> Exchange(v1::ChannelRequest& request) {
    int fd = -1;
    absl::StatusOr<v1::ChannelResponse> response = memory_.Exchange(session_id(), request, &fd);
    if (fd >= 0) close(fd);
    return response;
  }

  // The read-only mapping of host segment `key` (`size` bytes as the daemon says), made on
  // first use from a descriptor the memory channel brings, and shared by every tensor in it.
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> MapHostSegment(const SegmentKey& key,
                                                                       uint64_t size);
  // A writable mapping of exactly `location`'s buffer (this session's own); the caller munmaps.
  absl::StatusOr<void*> MapHostBuffer(const v1::Location& location);

  // Stock: buffers the daemon made ahead of need, mapped writable, by buffer length.
  struct StockedBuffer {
    uint64_t tensor_id = 0;
    void* mapping = nullptr;  // `length` bytes
    v1::Location location;
  };
  // A stocked buffer of `length` bytes, taken out of the stock; nullopt if there is none.
  std::optional<StockedBuffer> TakeStock(uint64_t length) ABSL_LOCKS_EXCLUDED(stock_mu_);
  // How many buffers of `length` bytes to ask for now (0: enough in stock, not stockable, or
  // not created often enough yet).
  uint32_t StockWanted(uint64_t length) const ABSL_LOCKS_EXCLUDED(stock_mu_);
  // Counts a create of a tensor with a buffer of `length` bytes.
  void NoteCreate(uint64_t length) ABSL_LOCKS_EXCLUDED(stock_mu_) {
    MutexLock lock(&stock_mu_);
    ++creates_[length];
  }
  // Maps and keeps what the daemon stocked for the current session; what cannot be mapped is
  // left to the session's end.
  void AddStock(const google::protobuf::RepeatedPtrField<v1::StockedBuffer>& stocked)
      ABSL_LOCKS_EXCLUDED(stock_mu_);
  // Forgets the stock (the session it belonged to ended, and the daemon frees it).
  void DropStock() ABSL_LOCKS_EXCLUDED(stock_mu_);

  // The sender thread's body; returns once the Client is gone and no tensor is outstanding.
  void SendReleases(std::shared_ptr<ClientCore> self);
  // Tells the sender the Client is gone; true if nothing is outstanding (it will exit soon).
  bool CloseClient() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Flush() ABSL_LOCKS_EXCLUDED(mu_);

  void PrepareContext(grpc::ClientContext& context, absl::Duration timeout) const
      ABSL_LOCKS_EXCLUDED(mu_);
  v1::TensorShm::Stub& stub() { return *stub_; }
  SegmentMap& segments() { return segments_; }
  CudaState& cuda() { return cuda_; }
  std::string session_id() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& socket() const { return socket_; }

 private:
  struct HeldLease {
    uint64_t tensor_id;
    uint64_t lease_id;  // in the current session; 0: the daemon no longer knows it
  };

  bool SenderDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return client_closed_ && outstanding_ == 0 && pending_leases_.empty() &&
           pending_abandons_.empty() && page_leases_.load(std::memory_order_acquire) == 0;
  }
  // After a session opened: maps its fast path (without one, acquires use the RPC).
  void SetUpFastPath() ABSL_LOCKS_EXCLUDED(mu_);
  // Before re-registering with a restarted daemon: the old session's page leases become
  // leases in held_, re-registered like the others.
  void RetireFastPath() ABSL_LOCKS_EXCLUDED(mu_);
  // Opens a session stream; with `reattach`, asks the daemon to take back what this client holds.
  absl::Status Open(bool reattach) ABSL_LOCKS_EXCLUDED(mu_);
  // After the stream broke: reopens a session, with backoff. False if the sender should exit.
  bool Reconnect() ABSL_LOCKS_EXCLUDED(mu_);
  // Fills `batch` from the queues (ids the daemon no longer knows are dropped); false if empty.
  bool TakeBatch(v1::ReleaseBatch* batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string socket_;
  const std::string client_name_;
  const uint64_t fork_generation_;
  const pid_t pid_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TensorShm::Stub> stub_;
  MemoryChannel memory_;
  // The session stream; replaced only by the thread that opens sessions (Connect, then sender).
  std::unique_ptr<grpc::ClientContext> session_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  SegmentMap segments_;
  CudaState cuda_;

  mutable Mutex mu_;
  CondVar work_;   // the sender has something to do
  CondVar acked_;  // a batch was acknowledged, or the stream broke
  std::string session_id_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, HeldLease> held_ ABSL_GUARDED_BY(mu_);  // by client-side key
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = 1;
  // Unpublished tensors the daemon knows as ours: client-side key -> tensor id.
  std::unordered_map<uint64_t, uint64_t> unpublished_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> pending_leases_ ABSL_GUARDED_BY(mu_);    // keys
  std::vector<uint64_t> pending_abandons_ ABSL_GUARDED_BY(mu_);  // keys
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t acked_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status rejection_ ABSL_GUARDED_BY(mu_);
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  bool client_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool flush_requested_ ABSL_GUARDED_BY(mu_) = false;  // send a batch even if empty
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;       // leases in held_ and unpublished tensors
  std::shared_ptr<FastPath> fast_ ABSL_GUARDED_BY(mu_);
  mutable Mutex stock_mu_;
  std::map<uint64_t, std::vector<StockedBuffer>> stock_ ABSL_GUARDED_BY(stock_mu_);
  uint64_t stock_bytes_ ABSL_GUARDED_BY(stock_mu_) = 0;
  std::map<uint64_t, uint64_t> creates_ ABSL_GUARDED_BY(stock_mu_);  // by buffer length
  // Leases held in lease page slots: counted without the mutex (a release is one store).
  std::atomic<int64_t> page_leases_{0};
  std::atomic<bool> closing_{false};  // client_closed_, for releases that do not lock
};

absl::Status ClientCore::Open(bool reattach) {
  auto context = std::make_unique<grpc::ClientContext>();
  v1::SessionRequest open;
  open.mutable_open()->set_client_version(TENSORSHM_VERSION);
  open.mutable_open()->set_pid(getpid());
  open.mutable_open()->set_client_name(client_name_);
  std::vector<uint64_t> keys;
  std::vector<uint64_t> unpublished_keys;
  if (reattach) {
    // Wait for the channel to reach the daemon again, a bounded time so that a Client closing
    // meanwhile is not kept waiting long. (A deadline on the stream itself would end it.)
    if (!channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + kReconnectWait))) {
      return absl::UnavailableError(absl::StrCat("tensorshmd at unix:", socket_, " not reachable"));
    }
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
  auto stream = stub_->Session(context.get());
  v1::SessionResponse opened;
  if (!stream->Write(open) || !stream->Read(&opened) || !opened.has_opened()) {
    stream->WritesDone();
    absl::Status status = FromGrpcStatus(stream->Finish());
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
    // The old stream (finished) goes before the context it was made with.
    stream_ = std::move(stream);
    session_context_ = std::move(context);
    connected_ = true;
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
    absl::StatusOr<void*> mapping = MapHostBuffer(buffer.location());
    if (!mapping.ok()) continue;
    MutexLock lock(&stock_mu_);
    stock_[buffer.location().length()].push_back(
        StockedBuffer{buffer.tensor_id(), *mapping, buffer.location()});
    stock_bytes_ += buffer.location().length();
  }
}

void ClientCore::DropStock() {
  MutexLock lock(&stock_mu_);
  for (auto& [length, buffers] : stock_) {
    for (const StockedBuffer& buffer : buffers) munmap(buffer.mapping, length);
  }
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
      pending_leases_.clear();
      pending_abandons_.clear();
      if (SenderDone()) return false;
    }
    if (Open(/*reattach=*/true).ok()) return true;
    MutexLock lock(&mu_);
    if (!SenderDone()) work_.WaitWithTimeout(&mu_, backoff);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

void ClientCore::PrepareContext(grpc::ClientContext& context, absl::Duration timeout) const {
  context.AddMetadata(kSessionMetadataKey, session_id());
  if (timeout != absl::InfiniteDuration()) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
}

std::string ClientCore::session_id() const {
  MutexLock lock(&mu_);
  return session_id_;
}

absl::Status ClientCore::CheckProcess() const {
  if (!forked()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this tensorshm client was connected in process ", pid_, "; process ", getpid(),
      " is a fork of it and may not use its connection, session or leases: connect again in "
      "this process"));
}

absl::StatusOr<std::shared_ptr<const SegmentMapping>> ClientCore::MapHostSegment(
    const SegmentKey& key, uint64_t segment_size) {
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
  return segments_.Insert(key, *fd, segment_size);
}

absl::StatusOr<void*> ClientCore::MapHostBuffer(const v1::Location& location) {
  const SegmentKey key{location.segment_instance(), location.segment_id()};
  absl::StatusOr<void*> mapping =
      segments_.MapWritableRange(key, location.offset(), location.length());
  if (!absl::IsNotFound(mapping.status())) return mapping;
  uint64_t size = 0;
  absl::StatusOr<int> fd =
      memory_.RequestSegment(session_id(), key.first, key.second, /*writable=*/true, &size);
  if (!fd.ok()) return fd.status();
  segments_.InsertWritable(key, *fd);
  return segments_.MapWritableRange(key, location.offset(), location.length());
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
  --outstanding_;
  work_.Signal();
}

void ClientCore::QueueAbandon(uint64_t key) noexcept {
  MutexLock lock(&mu_);
  pending_abandons_.push_back(key);
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
  // and an empty batch makes it look (and free what they held).
  const uint64_t target = next_sequence_;
  flush_requested_ = true;
  work_.Signal();
  while (acked_sequence_ < target && connected_) acked_.Wait(&mu_);
  if (acked_sequence_ < target) {
    return absl::UnavailableError(
        absl::StrCat("session with tensorshmd at unix:", socket_, " ended; reconnecting"));
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
  taken = 0;
  for (; taken < pending_abandons_.size() && batch->abandoned_tensor_ids_size() < kMaxBatch;
       ++taken) {
    auto it = unpublished_.find(pending_abandons_[taken]);
    if (it == unpublished_.end()) continue;
    batch->add_abandoned_tensor_ids(it->second);
    unpublished_.erase(it);
  }
  pending_abandons_.erase(pending_abandons_.begin(), pending_abandons_.begin() + taken);
  return batch->lease_ids_size() > 0 || batch->abandoned_tensor_ids_size() > 0;
}

void ClientCore::SendReleases(std::shared_ptr<ClientCore> self) {
  while (true) {
    v1::SessionRequest request;
    uint64_t sequence = 0;
    {
      MutexLock lock(&mu_);
      bool probe = false;
      while (connected_ && pending_leases_.empty() && pending_abandons_.empty() &&
             !flush_requested_ && !SenderDone()) {
        // The sync stream says nothing until used, so a daemon gone while this client is idle
        // shows as the channel leaving READY, or sooner as the index's heartbeat going stale (a
        // connection nobody polls may look READY for seconds): an empty batch then tells
        // whether the stream lives.
        if (work_.WaitWithTimeout(&mu_, kIdleCheck) &&
            (channel_->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY ||
             (fast_ != nullptr && !fast_->DaemonServing()))) {
          probe = true;
          break;
        }
      }
      if (SenderDone()) break;
      if (connected_) {
        sequence = next_sequence_++;
        request.mutable_release()->set_sequence(sequence);
        const bool flush = flush_requested_;
        flush_requested_ = false;
        if (!TakeBatch(request.mutable_release()) && !probe && !flush) {
          // Only ids the daemon no longer knows: nothing to send.
          acked_sequence_ = sequence;
          acked_.SignalAll();
          continue;
        }
      }
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

// ---- Acquired tensors ----

namespace {

// What an acquired tensor's manager_ctx points at: the lease and storage for shape and strides.
struct Lease {
  DLManagedTensorVersioned versioned{};
  DLManagedTensor legacy{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  uint64_t key = 0;  // ClientCore's key for the lease (an RPC lease)
  std::shared_ptr<ClientCore> core;
  std::shared_ptr<FastPath> fast;  // a page lease: the fast path whose page holds it
  uint32_t page_slot = 0;
  std::shared_ptr<const SegmentMapping> mapping;  // host tensors: the segment the data lies in
  int cuda_ordinal = -1;                          // CUDA tensors: this process's device ordinal
  std::string ready_event;  // CUDA tensors: the producer's CUipcEventHandle, or empty
};

void ReleaseLease(Lease* lease) noexcept {
  if (lease->core->forked()) {
    // The lease is the parent's: the child only lets go of its own copy of the tensor.
    KeepForever(std::move(lease->core));
  } else if (lease->fast != nullptr) {
    lease->core->ReleasePageLease(*lease->fast, lease->page_slot);
  } else {
    lease->core->QueueRelease(lease->key);
  }
  delete lease;
}

void DeleteVersioned(DLManagedTensorVersioned* self) noexcept {
  if (self != nullptr) ReleaseLease(static_cast<Lease*>(self->manager_ctx));
}

void DeleteLegacy(DLManagedTensor* self) noexcept {
  if (self != nullptr) ReleaseLease(static_cast<Lease*>(self->manager_ctx));
}

// A CUDA location as this process sees it: its ordinal for the location's device (found by UUID)
// and the buffer's device address (nullptr for an empty tensor), the segment opened once.
struct CudaBuffer {
  int ordinal = -1;
  char* data = nullptr;
};

absl::StatusOr<CudaBuffer> OpenCudaLocation(ClientCore& core, const v1::Location& location) {
  const v1::CudaLocation& cuda = location.cuda();
  absl::StatusOr<int> ordinal = core.cuda().OrdinalOf(cuda.device_uuid());
  if (!ordinal.ok()) return ordinal.status();
  CudaBuffer buffer{*ordinal, nullptr};
  if (location.length() > 0) {
    absl::StatusOr<CUdeviceptr> base = core.cuda().OpenSegment(
        *ordinal, SegmentKey{location.segment_instance(), location.segment_id()},
        cuda.ipc_handle());
    if (!base.ok()) return base.status();
    buffer.data = reinterpret_cast<char*>(*base + location.offset());
  }
  return buffer;
}

// Points `lease`'s DLPack structs at `data` with its shape and strides.
void FillTensor(Lease& lease, const char* data, DLDevice device, DLDataType dtype,
                uint64_t byte_offset, uint64_t flags) {
  DLTensor tensor{};
  tensor.data = const_cast<char*>(data);
  tensor.device = device;
  tensor.ndim = static_cast<int32_t>(lease.shape.size());
  tensor.dtype = dtype;
  tensor.shape = lease.shape.data();
  tensor.strides = lease.strides.data();
  tensor.byte_offset = byte_offset;
  lease.versioned.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  lease.versioned.manager_ctx = &lease;
  lease.versioned.flags = DLPACK_FLAG_BITMASK_READ_ONLY | flags;
  lease.versioned.dl_tensor = tensor;
  lease.legacy.manager_ctx = &lease;
  lease.legacy.dl_tensor = tensor;
}

// Builds the tensor for a lease the daemon granted. On failure the lease is given back.
absl::StatusOr<std::unique_ptr<Lease>> MakeLease(const std::shared_ptr<ClientCore>& core,
                                                 const v1::AcquireResponse& response) {
  auto lease = std::make_unique<Lease>();
  lease->core = core;
  // From here a failure must still give the lease back.
  lease->key = core->AddLease(response.tensor_id(), response.lease_id());
  auto give_back = [&](absl::Status status) {
    core->QueueRelease(lease->key);
    return status;
  };
  absl::StatusOr<DecodedTensor> decoded = DecodeDescriptor(response.desc(), response.location());
  if (!decoded.ok()) {
    return give_back(absl::InternalError(
        absl::StrCat("tensorshmd sent a bad descriptor: ", decoded.status().message())));
  }
  const v1::Location& location = response.location();
  const char* data = kEmptyData;
  if (decoded->device.device_type == kDLCUDA && location.has_cuda()) {
    absl::StatusOr<CudaBuffer> buffer = OpenCudaLocation(*core, location);
    if (!buffer.ok()) return give_back(buffer.status());
    decoded->device.device_id = buffer->ordinal;
    lease->cuda_ordinal = buffer->ordinal;
    lease->ready_event = location.cuda().ready_event();
    data = buffer->data;
  } else if (decoded->device.device_type != kDLCPU ||
             (!location.has_host() && location.length() > 0)) {
    return give_back(absl::UnimplementedError(
        absl::StrCat("device = ", DeviceName(decoded->device), ": not supported by this client")));
  } else if (location.length() > 0) {
    absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping = core->MapHostSegment(
        SegmentKey{location.segment_instance(), location.segment_id()}, location.segment_size());
    if (!mapping.ok()) return give_back(mapping.status());
    lease->mapping = *std::move(mapping);
    data = lease->mapping->address() + location.offset();
  }
  lease->shape = std::move(decoded->shape);
  lease->strides = std::move(decoded->strides);
  FillTensor(*lease, data, decoded->device, decoded->dtype, decoded->byte_offset, decoded->flags);
  return lease;
}

// Builds the tensor for a lease slot the fast path took. On failure the slot is given back.
absl::StatusOr<std::unique_ptr<Lease>> MakePageLease(const std::shared_ptr<ClientCore>& core,
                                                     std::shared_ptr<FastPath> fast,
                                                     const FastPath::Leased& leased) {
  auto lease = std::make_unique<Lease>();
  lease->core = core;
  lease->fast = std::move(fast);
  lease->page_slot = leased.page_slot;
  core->PageLeaseTaken();
  const TensorRecord& record = *leased.record;
  const char* data = kEmptyData;
  if (record.length > 0) {
    absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping = core->MapHostSegment(
        SegmentKey{leased.segment_instance, record.segment_id}, leased.segment_size);
    if (!mapping.ok()) {
      core->ReleasePageLease(*lease->fast, lease->page_slot);
      return mapping.status();
    }
    lease->mapping = *std::move(mapping);
    data = lease->mapping->address() + record.offset;
  }
  lease->shape.assign(record.shape, record.shape + record.ndim);
  lease->strides.assign(record.strides, record.strides + record.ndim);
  FillTensor(*lease, data, DLDevice{kDLCPU, 0},
             DLDataType{record.dtype_code, record.dtype_bits, record.dtype_lanes},
             record.byte_offset, record.dlpack_flags);
  return lease;
}

// Waits for `lease`'s ready event as `sync` says.
absl::Status WaitLeaseReady(const Lease& lease, ReadySync sync) {
  if (lease.ready_event.empty() || sync.mode == ReadySync::Mode::kNone) return absl::OkStatus();
  return lease.core->cuda().WaitReady(lease.cuda_ordinal, lease.ready_event,
                                      sync.mode == ReadySync::Mode::kHost,
                                      static_cast<CUstream>(sync.stream));
}

absl::StatusOr<std::unique_ptr<Lease>> AcquireLease(const std::shared_ptr<ClientCore>& core,
                                                    std::string_view name, absl::Duration timeout,
                                                    ReadySync sync) {
  if (absl::Status s = core->CheckProcess(); !s.ok()) return s;
  if (absl::Status s = ValidateName(View(name)); !s.ok()) return s;
  if (timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout = ", absl::FormatDuration(timeout), ": must be >= 0"));
  }
  // The fast path answers from shared memory, and waits on the index's futex word; whatever it
  // cannot answer goes to the daemon with the time that is left.
  if (std::shared_ptr<FastPath> fast = core->fast_path(); fast != nullptr) {
    const absl::Time deadline =
        timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
    while (true) {
      const uint32_t seen = fast->publishes();
      FastPath::Leased leased;
      const FastPath::Outcome outcome = fast->TryAcquire(name, &leased);
      if (outcome == FastPath::Outcome::kLeased) return MakePageLease(core, fast, leased);
      if (outcome == FastPath::Outcome::kFallback) break;
      if (timeout == absl::ZeroDuration()) {
        return absl::NotFoundError(absl::StrCat("name = \"", View(name), "\": not published"));
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "name = \"", View(name), "\": not published within ", absl::FormatDuration(timeout)));
      }
      if (absl::Status s = core->CheckProcess(); !s.ok()) return s;
      fast->WaitForPublish(seen, deadline - now);
    }
    if (timeout != absl::InfiniteDuration()) {
      timeout = std::max(absl::ZeroDuration(), deadline - absl::Now());
    }
  }
  v1::AcquireRequest request;
  request.set_name(std::string(name));
  grpc::ClientContext context;
  if (timeout == absl::InfiniteDuration()) {
    request.set_wait_ms(-1);
    core->PrepareContext(context, absl::InfiniteDuration());
  } else {
    const int64_t wait_ms = absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1)));
    request.set_wait_ms(wait_ms);
    // The call's own deadline leaves room for the daemon to answer DEADLINE_EXCEEDED itself.
    core->PrepareContext(context, timeout + kCallTimeout);
  }
  v1::AcquireResponse response;
  if (absl::Status s = FromGrpcStatus(core->stub().Acquire(&context, request, &response));
      !s.ok()) {
    return s;
  }
  absl::StatusOr<std::unique_ptr<Lease>> lease = MakeLease(core, response);
  if (!lease.ok()) return lease.status();
  if (absl::Status s = WaitLeaseReady(**lease, sync); !s.ok()) {
    core->QueueRelease((*lease)->key);
    return s;
  }
  return lease;
}

}  // namespace

absl::Status CopyToHost(const DLManagedTensorVersioned* tensor, const void* src, void* dst,
                        size_t bytes) {
  if (tensor == nullptr || tensor->deleter != DeleteVersioned ||
      tensor->dl_tensor.device.device_type != kDLCUDA) {
    return absl::InvalidArgumentError("tensor: not a CUDA tensor acquired from a tensorshm Client");
  }
  const auto& lease = *static_cast<const Lease*>(tensor->manager_ctx);
  if (absl::Status s = WaitLeaseReady(lease, ReadySync::Host()); !s.ok()) return s;
  return lease.core->cuda().CopyDeviceToHost(lease.cuda_ordinal, dst,
                                             reinterpret_cast<CUdeviceptr>(src), bytes);
}

absl::Status LeaseStatus(const DLManagedTensorVersioned* tensor) {
  if (tensor == nullptr || tensor->deleter != DeleteVersioned) {
    return absl::InvalidArgumentError("tensor: not acquired from a tensorshm Client");
  }
  const auto& lease = *static_cast<const Lease*>(tensor->manager_ctx);
  if (absl::Status s = lease.core->CheckProcess(); !s.ok()) return s;
  if (lease.fast != nullptr) return lease.core->PageLeaseStatus(*lease.fast, lease.page_slot);
  return lease.core->LeaseStatus(lease.key);
}

absl::Status WaitReady(const DLManagedTensorVersioned* tensor, ReadySync sync) {
  if (tensor == nullptr || tensor->deleter != DeleteVersioned) {
    return absl::InvalidArgumentError("tensor: not acquired from a tensorshm Client");
  }
  return WaitLeaseReady(*static_cast<const Lease*>(tensor->manager_ctx), sync);
}

// ---- Client ----

namespace {

// Sends `call` (holding `request`) over the memory channel, and the answer's field to
// `*response`; only when the channel cannot be had, makes the unary RPC `rpc` instead.
template <typename Request, typename Response>
absl::Status ChannelOrRpc(ClientCore& core, v1::ChannelRequest& call,
                          Response* (v1::ChannelResponse::*field)(),
                          grpc::Status (v1::TensorShm::Stub::*rpc)(grpc::ClientContext*,
                                                                   const Request&, Response*),
                          const Request& request, Response* response) {
  absl::StatusOr<v1::ChannelResponse> answer = core.Exchange(call);
  if (answer.ok()) {
    *response = std::move(*((*answer).*field)());
    return absl::OkStatus();
  }
  if (!absl::IsUnavailable(answer.status())) return answer.status();
  grpc::ClientContext context;
  core.PrepareContext(context, kCallTimeout);
  return FromGrpcStatus((core.stub().*rpc)(&context, request, response));
}

}  // namespace

absl::StatusOr<std::shared_ptr<Client>> Client::Connect(const ClientOptions& options) {
  PrepareProcessForClients();
  const std::string socket = options.socket.empty() ? DefaultSocketPath() : options.socket;
  RememberDaemonSocket(socket);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // Each client owns its connection. Through gRPC's process-wide subchannel pool, a new client
  // would share an old one's connection: one inherited across fork(), which the child would
  // then write into, or one still broken after the daemon restarted.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // gRPC's own reconnect backoff grows to minutes; a restarted daemon should be found in seconds.
  // (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS stays at its default: it is also the connect timeout, and
  // a short one aborts handshakes with a busy daemon.)
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "tensorshmd is not reachable at unix:", socket, " (is it running? socket from ",
        options.socket.empty() ? "the default path" : "ClientOptions::socket", ")"));
  }
  std::string name = options.client_name;
  if (name.empty()) name = absl::StrCat("pid-", getpid());
  auto core = std::make_shared<ClientCore>(socket, std::move(channel), std::move(name));
  if (absl::Status s = core->OpenSession(); !s.ok()) return s;
  std::shared_ptr<Client> client(new Client(core));
  client->sender_ = std::thread(&ClientCore::SendReleases, core.get(), core);
  return client;
}

Client::~Client() {
  if (core_->forked()) {
    // The parent's: its sender thread does not exist here, and its connection must stay open.
    KeepForever(std::move(core_), new std::thread(std::move(sender_)));
    return;
  }
  if (core_->CloseClient()) {
    sender_.join();  // nothing outstanding: the sender closes the session and exits
  } else {
    // Tensors outlive the Client: the sender keeps the session open until their deleters ran.
    sender_.detach();
  }
}

std::string Client::session_id() const { return core_->session_id(); }

absl::Status Client::Flush() {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  return core_->Flush();
}

absl::Status Client::CopyOnDevice(int ordinal, void* dst, const void* src, size_t bytes,
                                  CudaStream stream) {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  return core_->cuda().CopyDeviceToDevice(ordinal, reinterpret_cast<CUdeviceptr>(dst),
                                          reinterpret_cast<CUdeviceptr>(src), bytes,
                                          static_cast<CUstream>(stream));
}

absl::StatusOr<WritableTensor> Client::Create(const TensorSpec& spec) {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  // A host tensor whose buffer length is in stock is made here, without asking the daemon.
  uint64_t stock_length = 0;
  if (spec.device.device_type == kDLCPU && spec.device.device_id == 0) {
    absl::StatusOr<TensorLayout> layout =
        ComputeLayout(spec.dtype, spec.shape, spec.strides, spec.subbyte_padded);
    if (layout.ok() && layout->nbytes > 0) {
      const uint64_t page = static_cast<uint64_t>(getpagesize());
      stock_length = (layout->byte_offset + layout->nbytes + page - 1) / page * page;
      core_->NoteCreate(stock_length);
      if (std::optional<ClientCore::StockedBuffer> stocked = core_->TakeStock(stock_length)) {
        WritableTensor tensor;
        tensor.core_ = core_;
        tensor.tensor_id_ = stocked->tensor_id;
        tensor.key_ = core_->AddUnpublished(stocked->tensor_id);
        tensor.stocked_ = true;
        tensor.mapping_ = stocked->mapping;
        tensor.mapping_length_ = stock_length;
        tensor.shape_ = spec.shape;
        tensor.strides_ = std::move(layout->strides);
        tensor.nbytes_ = layout->nbytes;
        tensor.flags_ = spec.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0;
        tensor.tensor_.data = stocked->mapping;
        tensor.tensor_.device = spec.device;
        tensor.tensor_.ndim = static_cast<int32_t>(tensor.shape_.size());
        tensor.tensor_.dtype = spec.dtype;
        tensor.tensor_.shape = tensor.shape_.data();
        tensor.tensor_.strides = tensor.strides_.data();
        tensor.tensor_.byte_offset = layout->byte_offset;
        tensor.segment_instance_ = stocked->location.segment_instance();
        tensor.segment_id_ = stocked->location.segment_id();
        tensor.segment_size_ = stocked->location.segment_size();
        tensor.buffer_offset_ = stocked->location.offset();
        return tensor;
      }
    }
  }
  v1::ChannelRequest call;
  v1::CreateRequest& request = *call.mutable_create();
  request.set_stock(core_->StockWanted(stock_length));
  ToWire(spec.dtype, request.mutable_dtype());
  request.mutable_shape()->Assign(spec.shape.begin(), spec.shape.end());
  request.mutable_strides()->Assign(spec.strides.begin(), spec.strides.end());
  ToWire(spec.device, request.mutable_device());
  request.set_subbyte_padded(spec.subbyte_padded);
  if (spec.device.device_type == kDLCUDA) {
    // The daemon numbers devices its own way: the UUID names the device.
    absl::StatusOr<std::string> uuid = core_->cuda().UuidOf(spec.device.device_id);
    if (!uuid.ok()) return uuid.status();
    request.set_device_uuid(*std::move(uuid));
  }
  v1::CreateResponse response;
  if (absl::Status s = ChannelOrRpc(*core_, call, &v1::ChannelResponse::mutable_created,
                                    &v1::TensorShm::Stub::Create, request, &response);
      !s.ok()) {
    return s;
  }
  core_->AddStock(response.stocked());
  WritableTensor tensor;
  tensor.core_ = core_;
  tensor.tensor_id_ = response.tensor_id();
  tensor.key_ = core_->AddUnpublished(tensor.tensor_id_);
  // From here on `tensor`'s destructor gives the buffer back if anything fails.
  absl::StatusOr<DecodedTensor> decoded = DecodeDescriptor(response.desc(), response.location());
  if (!decoded.ok()) {
    return absl::InternalError(
        absl::StrCat("tensorshmd sent a bad descriptor: ", decoded.status().message()));
  }
  const v1::Location& location = response.location();
  void* data = const_cast<char*>(kEmptyData);
  if (location.has_cuda()) {
    absl::StatusOr<CudaBuffer> buffer = OpenCudaLocation(*core_, location);
    if (!buffer.ok()) return buffer.status();
    decoded->device.device_id = buffer->ordinal;
    data = buffer->data;
  } else if (location.length() > 0) {
    absl::StatusOr<void*> mapping = core_->MapHostBuffer(location);
    if (!mapping.ok()) return mapping.status();
    tensor.mapping_ = *mapping;
    tensor.mapping_length_ = location.length();
    tensor.segment_instance_ = location.segment_instance();
    tensor.segment_id_ = location.segment_id();
    tensor.segment_size_ = location.segment_size();
    tensor.buffer_offset_ = location.offset();
    data = *mapping;
  }
  tensor.shape_ = std::move(decoded->shape);
  tensor.strides_ = std::move(decoded->strides);
  tensor.nbytes_ = decoded->nbytes;
  tensor.flags_ = decoded->flags;
  tensor.tensor_.data = data;
  tensor.tensor_.device = decoded->device;
  tensor.tensor_.ndim = static_cast<int32_t>(tensor.shape_.size());
  tensor.tensor_.dtype = decoded->dtype;
  tensor.tensor_.shape = tensor.shape_.data();
  tensor.tensor_.strides = tensor.strides_.data();
  tensor.tensor_.byte_offset = decoded->byte_offset;
  return tensor;
}

absl::Status Client::Publish(WritableTensor& tensor, std::string_view name, bool replace,
                             CudaStream ready_stream) {
  return PublishImpl(tensor, name, replace, ready_stream, nullptr);
}

absl::StatusOr<DLManagedTensorVersioned*> Client::PublishAndAcquire(WritableTensor& tensor,
                                                                    std::string_view name,
                                                                    bool replace,
                                                                    CudaStream ready_stream) {
  // A host tensor is leased through the lease page: the slot is taken before the publish, so
  // that nothing can free the tensor between its publish and the lease, and no RPC lease is
  // needed. (A CUDA tensor, or no free slot: the daemon takes the lease in the publish.)
  // Before the slot: a fork child must not write into its parent's lease page.
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  std::shared_ptr<FastPath> fast = core_->fast_path();
  uint32_t page_slot = 0;
  if (fast != nullptr && tensor.core_ == core_ && !tensor.published_ &&
      tensor.tensor_.device.device_type == kDLCPU && fast->Pin(tensor.tensor_id_, &page_slot)) {
    core_->PageLeaseTaken();
    auto lease = std::make_unique<Lease>();
    lease->core = core_;
    lease->fast = fast;
    lease->page_slot = page_slot;
    const char* data = kEmptyData;
    if (tensor.mapping_length_ > 0) {
      absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping = core_->MapHostSegment(
          SegmentKey{tensor.segment_instance_, tensor.segment_id_}, tensor.segment_size_);
      if (!mapping.ok()) {
        core_->ReleasePageLease(*fast, page_slot);
        return mapping.status();
      }
      lease->mapping = *std::move(mapping);
      data = lease->mapping->address() + tensor.buffer_offset_;
    }
    lease->shape = tensor.shape_;
    lease->strides = tensor.strides_;
    FillTensor(*lease, data, tensor.tensor_.device, tensor.tensor_.dtype,
               tensor.tensor_.byte_offset, tensor.flags_);
    if (absl::Status s = PublishImpl(tensor, name, replace, ready_stream, nullptr); !s.ok()) {
      core_->ReleasePageLease(*fast, page_slot);
      return s;
    }
    Lease* raw = lease.release();
    raw->versioned.deleter = DeleteVersioned;
    return &raw->versioned;
  }
  v1::AcquireResponse acquired;
  if (absl::Status s = PublishImpl(tensor, name, replace, ready_stream, &acquired); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::unique_ptr<Lease>> lease = MakeLease(core_, acquired);
  if (!lease.ok()) return lease.status();
  Lease* raw = lease->release();
  raw->versioned.deleter = DeleteVersioned;
  return &raw->versioned;
}

absl::Status Client::PublishImpl(WritableTensor& tensor, std::string_view name, bool replace,
                                 CudaStream ready_stream, v1::AcquireResponse* acquired) {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  if (tensor.published_ || tensor.core_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", tensor.tensor_id_, ": already published or moved from"));
  }
  if (tensor.core_ != core_) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", tensor.tensor_id_, ": created by another client"));
  }
  if (absl::Status s = ValidateName(View(name)); !s.ok()) return s;
  // Refused if a restarted daemon did not take the tensor back: its id may name another now.
  if (absl::Status s = core_->UnpublishedId(tensor.key_).status(); !s.ok()) return s;
  v1::ChannelRequest call;
  v1::PublishRequest& request = *call.mutable_publish();
  request.set_tensor_id(tensor.tensor_id_);
  request.set_name(std::string(name));
  request.set_replace(replace);
  request.set_acquire(acquired != nullptr);
  if (tensor.stocked_) {
    v1::TensorDesc* desc = request.mutable_desc();
    ToWire(tensor.tensor_.dtype, desc->mutable_dtype());
    desc->mutable_shape()->Assign(tensor.shape_.begin(), tensor.shape_.end());
    desc->mutable_strides()->Assign(tensor.strides_.begin(), tensor.strides_.end());
    desc->set_flags(tensor.flags_);
  }
  if (tensor.tensor_.device.device_type == kDLCPU) {
    request.set_stock(core_->StockWanted(tensor.mapping_length_));
    request.set_stock_bytes(tensor.mapping_length_);
  }
  if (tensor.tensor_.device.device_type == kDLCUDA) {
    // Acquirers wait for what was issued on the producer's stream up to here.
    absl::StatusOr<std::string> event = core_->cuda().RecordReadyEvent(
        tensor.tensor_.device.device_id, static_cast<CUstream>(ready_stream));
    if (!event.ok()) return event.status();
    request.set_ready_event(*std::move(event));
  }
  v1::PublishResponse response;
  if (absl::Status s = ChannelOrRpc(*core_, call, &v1::ChannelResponse::mutable_published,
                                    &v1::TensorShm::Stub::Publish, request, &response);
      !s.ok()) {
    return s;
  }
  core_->AddStock(response.stocked());
  tensor.Unmap();
  tensor.published_ = true;
  core_->Published(tensor.key_);
  if (acquired != nullptr) *acquired = std::move(*response.mutable_acquired());
  return absl::OkStatus();
}

absl::StatusOr<DLManagedTensorVersioned*> Client::Acquire(std::string_view name,
                                                          absl::Duration timeout, ReadySync sync) {
  absl::StatusOr<std::unique_ptr<Lease>> lease = AcquireLease(core_, name, timeout, sync);
  if (!lease.ok()) return lease.status();
  Lease* raw = lease->release();
  raw->versioned.deleter = DeleteVersioned;
  return &raw->versioned;
}

absl::StatusOr<DLManagedTensor*> Client::AcquireLegacy(std::string_view name,
                                                       absl::Duration timeout, ReadySync sync) {
  absl::StatusOr<std::unique_ptr<Lease>> lease = AcquireLease(core_, name, timeout, sync);
  if (!lease.ok()) return lease.status();
  Lease* raw = lease->release();
  raw->legacy.deleter = DeleteLegacy;
  return &raw->legacy;
}

absl::Status Client::Delete(std::string_view name) {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  if (absl::Status s = ValidateName(View(name)); !s.ok()) return s;
  v1::ChannelRequest call;
  v1::DeleteRequest& request = *call.mutable_delete_();
  request.set_name(std::string(name));
  v1::DeleteResponse response;
  return ChannelOrRpc(*core_, call, &v1::ChannelResponse::mutable_deleted,
                      &v1::TensorShm::Stub::Delete, request, &response);
}

absl::StatusOr<std::vector<TensorInfo>> Client::List(std::string_view prefix) {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  if (absl::Status s = ValidateNamePrefix(View(prefix)); !s.ok()) return s;
  v1::ListRequest request;
  request.set_prefix(std::string(prefix));
  grpc::ClientContext context;
  core_->PrepareContext(context, kCallTimeout);
  v1::ListResponse response;
  if (absl::Status s = FromGrpcStatus(core_->stub().List(&context, request, &response)); !s.ok()) {
    return s;
  }
  std::vector<TensorInfo> result;
  for (const v1::TensorInfo& info : response.tensors()) {
    TensorInfo& out = result.emplace_back();
    out.name = info.name();
    out.tensor_id = info.tensor_id();
    out.dtype = DLDataType{static_cast<uint8_t>(info.desc().dtype().code()),
                           static_cast<uint8_t>(info.desc().dtype().bits()),
                           static_cast<uint16_t>(info.desc().dtype().lanes())};
    out.device = FromWire(info.desc().device());
    out.shape.assign(info.desc().shape().begin(), info.desc().shape().end());
    out.strides.assign(info.desc().strides().begin(), info.desc().strides().end());
    out.nbytes = info.desc().nbytes();
    out.leases = info.leases();
  }
  return result;
}

absl::StatusOr<ServerStats> Client::Stat() {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  grpc::ClientContext context;
  core_->PrepareContext(context, kCallTimeout);
  v1::StatResponse response;
  if (absl::Status s = FromGrpcStatus(core_->stub().Stat(&context, v1::StatRequest(), &response));
      !s.ok()) {
    return s;
  }
  ServerStats stats;
  stats.tensors = response.tensors();
  stats.leases = response.leases();
  stats.sessions = response.sessions();
  for (const v1::PoolStats& pool : response.pools()) {
    stats.pools.push_back(
        PoolStats{FromWire(pool.device()), pool.capacity_bytes(), pool.used_bytes()});
  }
  return stats;
}

// ---- WritableTensor ----

WritableTensor::WritableTensor(WritableTensor&& other) noexcept { *this = std::move(other); }

WritableTensor& WritableTensor::operator=(WritableTensor&& other) noexcept {
  if (this == &other) return *this;
  Reset();
  core_ = std::move(other.core_);
  tensor_id_ = other.tensor_id_;
  key_ = other.key_;
  tensor_ = other.tensor_;
  shape_ = std::move(other.shape_);
  strides_ = std::move(other.strides_);
  tensor_.shape = shape_.data();
  tensor_.strides = strides_.data();
  mapping_ = other.mapping_;
  mapping_length_ = other.mapping_length_;
  nbytes_ = other.nbytes_;
  flags_ = other.flags_;
  published_ = other.published_;
  stocked_ = other.stocked_;
  segment_instance_ = other.segment_instance_;
  segment_id_ = other.segment_id_;
  segment_size_ = other.segment_size_;
  buffer_offset_ = other.buffer_offset_;
  other.mapping_ = nullptr;
  other.mapping_length_ = 0;
  other.tensor_ = DLTensor{};
  other.published_ = false;
  return *this;
}

WritableTensor::~WritableTensor() { Reset(); }

void WritableTensor::Reset() {
  Unmap();
  if (core_ != nullptr && core_->forked()) {
    // The parent's tensor: the child drops its own mapping and nothing else.
    KeepForever(std::move(core_));
  } else if (core_ != nullptr && !published_) {
    core_->QueueAbandon(key_);
  }
  core_.reset();
}

void* WritableTensor::data() const {
  if (tensor_.data == nullptr) return nullptr;
  return static_cast<char*>(tensor_.data) + tensor_.byte_offset;
}

std::pair<void*, size_t> WritableTensor::TakeMapping() {
  std::pair<void*, size_t> taken{mapping_, mapping_length_};
  mapping_ = nullptr;
  mapping_length_ = 0;
  return taken;
}

void WritableTensor::Unmap() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_length_);
  mapping_ = nullptr;
  mapping_length_ = 0;
  tensor_.data = nullptr;
}

}  // namespace tensorshm
