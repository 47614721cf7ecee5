#include "tensorshm/client.h"

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <sys/mman.h>
#include <unistd.h>

#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "client/segment_map.h"
#include "common/grpc_status.h"
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
constexpr size_t kMaxBatch = 4096;

// absl here predates its use of std::string_view, so names cross over explicitly.
absl::string_view View(std::string_view text) {
  return absl::string_view(text.data(), text.size());
}

// Data pointer of empty tensors: non-null and 256-byte aligned, never read.
alignas(256) const char kEmptyData[256] = {};

}  // namespace

// Everything a Client and its tensors share: the channel, the session stream, the release queue
// and the segment mappings. Lives as long as the Client or any tensor from it. Thread-safe.
class ClientCore {
 public:
  ClientCore(std::string socket, std::shared_ptr<grpc::Channel> channel)
      : socket_(std::move(socket)),
        channel_(std::move(channel)),
        stub_(v1::TensorShm::NewStub(channel_)) {}

  absl::Status OpenSession(const std::string& client_name);

  // Queue a lease release / an abandoned writable tensor for the sender thread. O(1), never
  // blocks on I/O. Each also ends one "outstanding" object.
  void QueueRelease(uint64_t lease_id) noexcept;
  void QueueAbandon(uint64_t tensor_id) noexcept;
  void AddOutstanding() ABSL_LOCKS_EXCLUDED(mu_);
  void DropOutstanding() ABSL_LOCKS_EXCLUDED(mu_);

  // The sender thread's body; returns once the Client is gone and no tensor is outstanding.
  void SendReleases(std::shared_ptr<ClientCore> self);
  // Tells the sender the Client is gone; true if nothing is outstanding (it will exit soon).
  bool CloseClient() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Flush() ABSL_LOCKS_EXCLUDED(mu_);

  void PrepareContext(grpc::ClientContext& context, absl::Duration timeout) const;
  v1::TensorShm::Stub& stub() { return *stub_; }
  SegmentMap& segments() { return segments_; }
  const std::string& session_id() const { return session_id_; }
  const std::string& socket() const { return socket_; }

 private:
  bool SenderDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return client_closed_ && outstanding_ == 0 && pending_leases_.empty() &&
           pending_abandons_.empty();
  }

  const std::string socket_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TensorShm::Stub> stub_;
  grpc::ClientContext session_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  std::string session_id_;
  SegmentMap segments_;

  Mutex mu_;
  CondVar work_;   // the sender has something to do
  CondVar acked_;  // a batch was acknowledged, or the stream broke
  std::vector<uint64_t> pending_leases_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> pending_abandons_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t acked_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status rejection_ ABSL_GUARDED_BY(mu_);
  bool stream_broken_ ABSL_GUARDED_BY(mu_) = false;
  bool client_closed_ ABSL_GUARDED_BY(mu_) = false;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::Status ClientCore::OpenSession(const std::string& client_name) {
  stream_ = stub_->Session(&session_context_);
  v1::SessionRequest open;
  open.mutable_open()->set_client_version(TENSORSHM_VERSION);
  open.mutable_open()->set_pid(getpid());
  open.mutable_open()->set_client_name(client_name);
  v1::SessionResponse opened;
  if (!stream_->Write(open) || !stream_->Read(&opened) || !opened.has_opened()) {
    stream_->WritesDone();
    absl::Status status = FromGrpcStatus(stream_->Finish());
    // A refusal (PERMISSION_DENIED, ...) keeps its code; a broken connection is UNAVAILABLE.
    const absl::StatusCode code = status.ok() || status.code() == absl::StatusCode::kCancelled
                                      ? absl::StatusCode::kUnavailable
                                      : status.code();
    return absl::Status(code, absl::StrCat("tensorshmd at unix:", socket_,
                                           " did not open a session: ", status.message()));
  }
  session_id_ = opened.opened().session_id();
  return absl::OkStatus();
}

void ClientCore::PrepareContext(grpc::ClientContext& context, absl::Duration timeout) const {
  context.AddMetadata(kSessionMetadataKey, session_id_);
  if (timeout != absl::InfiniteDuration()) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
}

void ClientCore::QueueRelease(uint64_t lease_id) noexcept {
  MutexLock lock(&mu_);
  pending_leases_.push_back(lease_id);
  --outstanding_;
  work_.Signal();
}

void ClientCore::QueueAbandon(uint64_t tensor_id) noexcept {
  MutexLock lock(&mu_);
  pending_abandons_.push_back(tensor_id);
  --outstanding_;
  work_.Signal();
}

void ClientCore::AddOutstanding() {
  MutexLock lock(&mu_);
  ++outstanding_;
}

void ClientCore::DropOutstanding() {
  MutexLock lock(&mu_);
  --outstanding_;
  work_.Signal();
}

bool ClientCore::CloseClient() {
  MutexLock lock(&mu_);
  client_closed_ = true;
  work_.Signal();
  return outstanding_ == 0;
}

absl::Status ClientCore::Flush() {
  MutexLock lock(&mu_);
  const uint64_t target =
      (pending_leases_.empty() && pending_abandons_.empty()) ? next_sequence_ - 1 : next_sequence_;
  work_.Signal();
  while (acked_sequence_ < target && !stream_broken_) acked_.Wait(&mu_);
  if (stream_broken_ && acked_sequence_ < target) {
    return absl::UnavailableError(
        absl::StrCat("session with tensorshmd at unix:", socket_, " ended"));
  }
  absl::Status result = rejection_;
  rejection_ = absl::OkStatus();
  return result;
}

void ClientCore::SendReleases(std::shared_ptr<ClientCore> self) {
  while (true) {
    v1::SessionRequest request;
    uint64_t sequence;
    {
      MutexLock lock(&mu_);
      while (pending_leases_.empty() && pending_abandons_.empty() && !SenderDone()) {
        work_.Wait(&mu_);
      }
      if (SenderDone()) break;
      v1::ReleaseBatch* batch = request.mutable_release();
      sequence = next_sequence_++;
      batch->set_sequence(sequence);
      const size_t leases = std::min(pending_leases_.size(), kMaxBatch);
      batch->mutable_lease_ids()->Assign(pending_leases_.begin(), pending_leases_.begin() + leases);
      pending_leases_.erase(pending_leases_.begin(), pending_leases_.begin() + leases);
      const size_t abandons = std::min(pending_abandons_.size(), kMaxBatch);
      batch->mutable_abandoned_tensor_ids()->Assign(pending_abandons_.begin(),
                                                    pending_abandons_.begin() + abandons);
      pending_abandons_.erase(pending_abandons_.begin(), pending_abandons_.begin() + abandons);
      if (stream_broken_) {
        // The daemon is gone and with it every lease of this session; nothing to send.
        acked_sequence_ = sequence;
        acked_.SignalAll();
        continue;
      }
    }
    v1::SessionResponse response;
    const bool ok = stream_->Write(request) && stream_->Read(&response) && response.has_ack();
    MutexLock lock(&mu_);
    if (!ok) {
      stream_broken_ = true;
    } else {
      for (const v1::Rejection& r : response.ack().rejected()) {
        if (rejection_.ok()) {
          rejection_ = absl::Status(static_cast<absl::StatusCode>(r.code()), r.message());
        }
      }
    }
    acked_sequence_ = sequence;
    acked_.SignalAll();
  }
  stream_->WritesDone();
  stream_->Finish().ok();
  // `self` kept the core alive while tensors outlived the Client; it goes here, possibly last.
  self.reset();
}

// ---- Acquired tensors ----

namespace {

// What an acquired tensor's manager_ctx points at: the lease and storage for shape and strides.
struct Lease {
  DLManagedTensorVersioned versioned{};
  DLManagedTensor legacy{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  uint64_t lease_id = 0;
  std::shared_ptr<ClientCore> core;
};

void ReleaseLease(Lease* lease) noexcept {
  lease->core->QueueRelease(lease->lease_id);
  delete lease;
}

void DeleteVersioned(DLManagedTensorVersioned* self) noexcept {
  if (self != nullptr) ReleaseLease(static_cast<Lease*>(self->manager_ctx));
}

void DeleteLegacy(DLManagedTensor* self) noexcept {
  if (self != nullptr) ReleaseLease(static_cast<Lease*>(self->manager_ctx));
}

// Builds the tensor for a lease the daemon granted. On failure the lease is given back.
absl::StatusOr<std::unique_ptr<Lease>> MakeLease(const std::shared_ptr<ClientCore>& core,
                                                 const v1::AcquireResponse& response) {
  auto lease = std::make_unique<Lease>();
  lease->lease_id = response.lease_id();
  lease->core = core;
  // From here a failure must still give the lease back.
  core->AddOutstanding();
  auto give_back = [&](absl::Status status) {
    core->QueueRelease(lease->lease_id);
    return status;
  };
  absl::StatusOr<DecodedTensor> decoded = DecodeDescriptor(response.desc(), response.location());
  if (!decoded.ok()) {
    return give_back(absl::InternalError(
        absl::StrCat("tensorshmd sent a bad descriptor: ", decoded.status().message())));
  }
  if (decoded->device.device_type != kDLCPU) {
    return give_back(absl::UnimplementedError(
        absl::StrCat("device = ", DeviceName(decoded->device), ": not supported by this client")));
  }
  const v1::Location& location = response.location();
  const char* data = kEmptyData;
  if (location.length() > 0) {
    absl::StatusOr<const char*> base =
        core->segments().MapReadOnly(location.host().shm_name(), location.segment_size());
    if (!base.ok()) return give_back(base.status());
    data = *base + location.offset();
  }
  lease->shape = std::move(decoded->shape);
  lease->strides = std::move(decoded->strides);
  DLTensor tensor{};
  tensor.data = const_cast<char*>(data);
  tensor.device = decoded->device;
  tensor.ndim = static_cast<int32_t>(lease->shape.size());
  tensor.dtype = decoded->dtype;
  tensor.shape = lease->shape.data();
  tensor.strides = lease->strides.data();
  tensor.byte_offset = decoded->byte_offset;
  lease->versioned.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  lease->versioned.manager_ctx = lease.get();
  lease->versioned.flags = DLPACK_FLAG_BITMASK_READ_ONLY | decoded->flags;
  lease->versioned.dl_tensor = tensor;
  lease->legacy.manager_ctx = lease.get();
  lease->legacy.dl_tensor = tensor;
  return lease;
}

absl::StatusOr<std::unique_ptr<Lease>> AcquireLease(const std::shared_ptr<ClientCore>& core,
                                                    std::string_view name, absl::Duration timeout) {
  if (absl::Status s = ValidateName(View(name)); !s.ok()) return s;
  if (timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout = ", absl::FormatDuration(timeout), ": must be >= 0"));
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
  return MakeLease(core, response);
}

}  // namespace

// ---- Client ----

absl::StatusOr<std::shared_ptr<Client>> Client::Connect(const ClientOptions& options) {
  const std::string socket = options.socket.empty() ? DefaultSocketPath() : options.socket;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "tensorshmd is not reachable at unix:", socket, " (is it running? socket from ",
        options.socket.empty() ? "the default path" : "ClientOptions::socket", ")"));
  }
  auto core = std::make_shared<ClientCore>(socket, std::move(channel));
  std::string name = options.client_name;
  if (name.empty()) name = absl::StrCat("pid-", getpid());
  if (absl::Status s = core->OpenSession(name); !s.ok()) return s;
  std::shared_ptr<Client> client(new Client(core));
  client->sender_ = std::thread(&ClientCore::SendReleases, core.get(), core);
  return client;
}

Client::~Client() {
  if (core_->CloseClient()) {
    sender_.join();  // nothing outstanding: the sender closes the session and exits
  } else {
    // Tensors outlive the Client: the sender keeps the session open until their deleters ran.
    sender_.detach();
  }
}

const std::string& Client::session_id() const { return core_->session_id(); }

absl::Status Client::Flush() { return core_->Flush(); }

absl::StatusOr<WritableTensor> Client::Create(const TensorSpec& spec) {
  v1::CreateRequest request;
  ToWire(spec.dtype, request.mutable_dtype());
  request.mutable_shape()->Assign(spec.shape.begin(), spec.shape.end());
  request.mutable_strides()->Assign(spec.strides.begin(), spec.strides.end());
  ToWire(spec.device, request.mutable_device());
  request.set_subbyte_padded(spec.subbyte_padded);
  grpc::ClientContext context;
  core_->PrepareContext(context, kCallTimeout);
  v1::CreateResponse response;
  if (absl::Status s = FromGrpcStatus(core_->stub().Create(&context, request, &response));
      !s.ok()) {
    return s;
  }
  WritableTensor tensor;
  tensor.core_ = core_;
  tensor.tensor_id_ = response.tensor_id();
  core_->AddOutstanding();
  // From here on `tensor`'s destructor gives the buffer back if anything fails.
  absl::StatusOr<DecodedTensor> decoded = DecodeDescriptor(response.desc(), response.location());
  if (!decoded.ok()) {
    return absl::InternalError(
        absl::StrCat("tensorshmd sent a bad descriptor: ", decoded.status().message()));
  }
  const v1::Location& location = response.location();
  void* data = const_cast<char*>(kEmptyData);
  if (location.length() > 0) {
    absl::StatusOr<void*> mapping =
        MapWritable(location.host().shm_name(), location.offset(), location.length());
    if (!mapping.ok()) return mapping.status();
    tensor.mapping_ = *mapping;
    tensor.mapping_length_ = location.length();
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

absl::Status Client::Publish(WritableTensor& tensor, std::string_view name, bool replace) {
  return PublishImpl(tensor, name, replace, nullptr);
}

absl::StatusOr<DLManagedTensorVersioned*> Client::PublishAndAcquire(WritableTensor& tensor,
                                                                    std::string_view name,
                                                                    bool replace) {
  v1::AcquireResponse acquired;
  if (absl::Status s = PublishImpl(tensor, name, replace, &acquired); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<Lease>> lease = MakeLease(core_, acquired);
  if (!lease.ok()) return lease.status();
  Lease* raw = lease->release();
  raw->versioned.deleter = DeleteVersioned;
  return &raw->versioned;
}

absl::Status Client::PublishImpl(WritableTensor& tensor, std::string_view name, bool replace,
                                 v1::AcquireResponse* acquired) {
  if (tensor.published_ || tensor.core_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", tensor.tensor_id_, ": already published or moved from"));
  }
  if (tensor.core_ != core_) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", tensor.tensor_id_, ": created by another client"));
  }
  if (absl::Status s = ValidateName(View(name)); !s.ok()) return s;
  v1::PublishRequest request;
  request.set_tensor_id(tensor.tensor_id_);
  request.set_name(std::string(name));
  request.set_replace(replace);
  request.set_acquire(acquired != nullptr);
  grpc::ClientContext context;
  core_->PrepareContext(context, kCallTimeout);
  v1::PublishResponse response;
  if (absl::Status s = FromGrpcStatus(core_->stub().Publish(&context, request, &response));
      !s.ok()) {
    return s;
  }
  tensor.Unmap();
  tensor.published_ = true;
  core_->DropOutstanding();
  if (acquired != nullptr) *acquired = std::move(*response.mutable_acquired());
  return absl::OkStatus();
}

absl::StatusOr<DLManagedTensorVersioned*> Client::Acquire(std::string_view name,
                                                          absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<Lease>> lease = AcquireLease(core_, name, timeout);
  if (!lease.ok()) return lease.status();
  Lease* raw = lease->release();
  raw->versioned.deleter = DeleteVersioned;
  return &raw->versioned;
}

absl::StatusOr<DLManagedTensor*> Client::AcquireLegacy(std::string_view name,
                                                       absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<Lease>> lease = AcquireLease(core_, name, timeout);
  if (!lease.ok()) return lease.status();
  Lease* raw = lease->release();
  raw->legacy.deleter = DeleteLegacy;
  return &raw->legacy;
}

absl::Status Client::Delete(std::string_view name) {
  if (absl::Status s = ValidateName(View(name)); !s.ok()) return s;
  v1::DeleteRequest request;
  request.set_name(std::string(name));
  grpc::ClientContext context;
  core_->PrepareContext(context, kCallTimeout);
  v1::DeleteResponse response;
  return FromGrpcStatus(core_->stub().Delete(&context, request, &response));
}

absl::StatusOr<std::vector<TensorInfo>> Client::List(std::string_view prefix) {
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
  other.mapping_ = nullptr;
  other.mapping_length_ = 0;
  other.tensor_ = DLTensor{};
  other.published_ = false;
  return *this;
}

WritableTensor::~WritableTensor() { Reset(); }

void WritableTensor::Reset() {
  Unmap();
  if (core_ != nullptr && !published_) core_->QueueAbandon(tensor_id_);
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
