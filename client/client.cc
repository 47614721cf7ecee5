#include "tensorshm/client.h"

#include <grpcpp/client_context.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cancel.h"
#include "client/client_core.h"
#include "client/cuda_state.h"
#include "client/daemon_connection.h"
#include "client/fast_path.h"
#include "client/fork.h"
#include "client/memory_channel.h"
#include "client/segment_map.h"
#include "common/tensor/grpc_status.h"
#include "common/tensor/layout.h"
#include "common/base/mutex.h"
#include "common/tensor/name.h"
#include "common/base/socket_path.h"
#include "common/tensor/wire.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {
namespace {

// absl here predates its use of std::string_view, so names cross over explicitly.
absl::string_view View(std::string_view text) {
  return absl::string_view(text.data(), text.size());
}

// Connect: the pause between attempts while the daemon's socket does not accept yet.
constexpr absl::Duration kConnectRetry = absl::Milliseconds(20);

// Data pointer of empty tensors: non-null and 256-byte aligned, never read.
alignas(256) const char kEmptyData[256] = {};

absl::Status Cancelled(std::string_view what) {
  return absl::CancelledError(absl::StrCat(View(what), ": the wait was cancelled"));
}

// Whether a call that failed with `status` may have been granted by the daemon all the same: the
// failure was the call's (a cancel, its deadline, its connection), not the daemon's answer, and
// could have crossed an OK answer. Such a call is settled (ClientCore::QueueSettle). The daemon
// answers DEADLINE_EXCEEDED itself before the call's own deadline, which is later (a wait's
// timeout + kCallTimeout): only an expiry here is the call's.
bool MayHaveBeenGranted(const absl::Status& status, const grpc::ClientContext& context) {
  switch (status.code()) {
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kAborted:
      return true;
    case absl::StatusCode::kDeadlineExceeded:
      return std::chrono::system_clock::now() >= context.deadline();
    default:
      return false;
  }
}

}  // namespace
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
  // ReadyEvent: the event opened from `ready_event` on first call, kept until the lease ends.
  Mutex event_mu;
  CUevent opened_event ABSL_GUARDED_BY(event_mu) = nullptr;
  bool own_event ABSL_GUARDED_BY(event_mu) = false;
};

void ReleaseLease(Lease* lease) noexcept {
  {
    MutexLock lock(&lease->event_mu);
    // A forked child leaves the driver alone (the event is the parent's business).
    if (lease->opened_event != nullptr && !lease->core->forked()) {
      lease->core->cuda().CloseEvent(lease->cuda_ordinal, lease->ready_event, lease->opened_event,
                                     lease->own_event);
    }
  }
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
    absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping =
        core->MapHostSegment(SegmentKey{location.segment_instance(), location.segment_id()},
                             location.segment_size(), location.offset(), location.length());
    if (!mapping.ok()) return give_back(mapping.status());
    lease->mapping = *std::move(mapping);
    data = lease->mapping->address() + location.offset();
  }
  lease->shape = std::move(decoded->shape);
  lease->strides = std::move(decoded->strides);
  FillTensor(*lease, data, decoded->device, decoded->dtype, decoded->byte_offset, decoded->flags);
  return lease;
}

// Builds the tensor for a lease slot the fast path took, from what TryAcquire copied out of the
// record. On failure the slot is given back (the caller then asks the daemon).
absl::StatusOr<std::unique_ptr<Lease>> MakePageLease(const std::shared_ptr<ClientCore>& core,
                                                     std::shared_ptr<FastPath> fast,
                                                     FastPath::Leased& leased) {
  auto lease = std::make_unique<Lease>();
  lease->core = core;
  lease->fast = std::move(fast);
  lease->page_slot = leased.page_slot;
  core->PageLeaseTaken();
  const char* data = kEmptyData;
  if (leased.length > 0) {
    // The mapping covers what the daemon says the segment holds; the record's byte range must
    // lie inside it (MapHostSegment refuses a segment smaller than `end`).
    const uint64_t end = leased.offset + leased.length;  // no overflow: TryAcquire checked
    absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping = core->MapHostSegment(
        SegmentKey{leased.segment_instance, leased.segment_id}, end, leased.offset, leased.length);
    if (mapping.ok() && (*mapping)->size() < end) {
      mapping = absl::FailedPreconditionError("the record's range is outside its segment");
    }
    if (!mapping.ok()) {
      core->ReleasePageLease(*lease->fast, lease->page_slot);
      return mapping.status();
    }
    lease->mapping = *std::move(mapping);
    data = lease->mapping->address() + leased.offset;
  }
  RecordLayout& layout = leased.layout;
  lease->shape = std::move(layout.shape);
  lease->strides = std::move(layout.layout.strides);
  FillTensor(*lease, data, DLDevice{kDLCPU, 0}, layout.dtype, layout.layout.byte_offset,
             layout.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0);
  return lease;
}

// Waits for `lease`'s ready event as `sync` says.
absl::Status WaitLeaseReady(const Lease& lease, ReadySync sync) {
  if (lease.ready_event.empty() || sync.mode == ReadySync::Mode::kNone) return absl::OkStatus();
  return lease.core->cuda().WaitReady(lease.cuda_ordinal, lease.ready_event,
                                      sync.mode == ReadySync::Mode::kHost,
                                      static_cast<CUstream>(sync.stream));
}

// `cancel` (may be null) ends a wait with CANCELLED. `local_only`: answer from the fast path or
// not at all (UNAVAILABLE where only the daemon could), with no call: a wait (timeout above zero)
// is on the fast path's futex alone.
absl::StatusOr<std::unique_ptr<Lease>> AcquireLease(const std::shared_ptr<ClientCore>& core,
                                                    std::string_view name, absl::Duration timeout,
                                                    ReadySync sync, CancelState* cancel,
                                                    bool local_only = false) {
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
    // Registered for the loop: Cancel wakes the futex sleep (a wake-up lost just before the
    // sleep begins costs at most one sleep, kLongestSleep in fast_path.cc).
    ScopedWait waiting(timeout == absl::ZeroDuration() ? nullptr : cancel,
                       CancelState::Wait{nullptr, fast.get()});
    const std::string what = absl::StrCat("name = \"", View(name), "\"");
    if (!waiting.registered()) return Cancelled(what);
    while (true) {
      const uint32_t seen = fast->publishes();
      FastPath::Leased leased;
      const FastPath::Outcome outcome = fast->TryAcquire(name, &leased);
      if (outcome == FastPath::Outcome::kLeased) {
        absl::StatusOr<std::unique_ptr<Lease>> lease = MakePageLease(core, fast, leased);
        // A segment that cannot be mapped as the record says: the daemon answers instead.
        if (lease.ok()) return lease;
        break;
      }
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
      if (cancel != nullptr && cancel->cancelled()) return Cancelled(what);
      fast->WaitForPublish(seen, deadline - now);
    }
    if (timeout != absl::InfiniteDuration()) {
      timeout = std::max(absl::ZeroDuration(), deadline - absl::Now());
    }
  }
  if (local_only) {
    return absl::UnavailableError(absl::StrCat(
        "name = \"", View(name), "\": the fast path cannot answer; ask the daemon (Acquire)"));
  }
  v1::AcquireRequest request;
  request.set_name(std::string(name));
  // The daemon settles a call whose answer this client does not take (a cancel or deadline
  // crossing its OK): it gives the lease back when told the id.
  const uint64_t request_id = core->NextRequestId();
  request.set_request_id(request_id);
  grpc::ClientContext context;
  std::string session;
  if (timeout == absl::InfiniteDuration()) {
    request.set_wait_ms(-1);
    session = core->PrepareContext(context, absl::InfiniteDuration());
  } else {
    const int64_t wait_ms = absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1)));
    request.set_wait_ms(wait_ms);
    // The call's own deadline leaves room for the daemon to answer DEADLINE_EXCEEDED itself.
    session = core->PrepareContext(context, timeout + kCallTimeout);
  }
  v1::AcquireResponse response;
  {
    ScopedWait waiting(timeout == absl::ZeroDuration() ? nullptr : cancel,
                       CancelState::Wait{&context, nullptr});
    if (!waiting.registered()) return Cancelled(absl::StrCat("name = \"", View(name), "\""));
    absl::Status s = FromGrpcStatus(core->stub()->Acquire(&context, request, &response));
    if (!s.ok() && MayHaveBeenGranted(s, context)) core->QueueSettle(session, request_id);
    if (absl::IsCancelled(s) && cancel != nullptr && cancel->cancelled()) {
      return Cancelled(absl::StrCat("name = \"", View(name), "\""));
    }
    if (!s.ok()) return s;
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

absl::StatusOr<const void*> ReadyEvent(const DLManagedTensorVersioned* tensor) {
  if (tensor == nullptr || tensor->deleter != DeleteVersioned) {
    return absl::InvalidArgumentError("tensor: not acquired from a tensorshm Client");
  }
  auto& lease = *static_cast<Lease*>(tensor->manager_ctx);
  if (lease.ready_event.empty()) return nullptr;
  MutexLock lock(&lease.event_mu);
  if (lease.opened_event == nullptr) {
    bool own = false;
    absl::StatusOr<CUevent> event =
        lease.core->cuda().OpenEvent(lease.cuda_ordinal, lease.ready_event, &own);
    if (!event.ok()) return event.status();
    lease.opened_event = *event;
    lease.own_event = own;
  }
  return static_cast<const void*>(&lease.opened_event);
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
  // The RPC only if the channel cannot be had: not after the daemon may have seen the request.
  if (!absl::IsUnavailable(answer.status()) || SentWithoutAnswer(answer.status())) {
    return answer.status();
  }
  grpc::ClientContext context;
  core.PrepareContext(context, kCallTimeout);
  return FromGrpcStatus(((*core.stub()).*rpc)(&context, request, response));
}

// The gRPC Create of `request`, waiting up to `timeout` (> 0; infinite: until the call ends) in
// the daemon for memory to be freed.
absl::Status CreateWaiting(ClientCore& core, const v1::CreateRequest& request,
                           absl::Duration timeout, CancelState* cancel,
                           v1::CreateResponse* response) {
  v1::CreateRequest waiting = request;
  // As an acquire's: a create whose answer this client does not take is settled (its buffers
  // freed) by the daemon.
  const uint64_t request_id = core.NextRequestId();
  waiting.set_request_id(request_id);
  grpc::ClientContext context;
  std::string session;
  if (timeout == absl::InfiniteDuration()) {
    waiting.set_wait_ms(-1);
    session = core.PrepareContext(context, absl::InfiniteDuration());
  } else {
    waiting.set_wait_ms(std::max<int64_t>(
        1, absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1)))));
    // The call's own deadline leaves room for the daemon to answer RESOURCE_EXHAUSTED itself.
    session = core.PrepareContext(context, timeout + kCallTimeout);
  }
  ScopedWait wait(cancel, CancelState::Wait{&context, nullptr});
  if (!wait.registered()) return Cancelled("create");
  absl::Status s = FromGrpcStatus(core.stub()->Create(&context, waiting, response));
  if (!s.ok() && MayHaveBeenGranted(s, context)) core.QueueSettle(session, request_id);
  if (absl::IsCancelled(s) && cancel != nullptr && cancel->cancelled()) return Cancelled("create");
  return s;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Client>> Client::Connect(const ClientOptions& options) {
  return ConnectImpl(options, nullptr);
}

absl::StatusOr<std::shared_ptr<Client>> Client::Connect(const ClientOptions& options,
                                                        const WaitCanceller& cancel) {
  return ConnectImpl(options, cancel.state_.get());
}

absl::StatusOr<std::shared_ptr<Client>> Client::ConnectImpl(const ClientOptions& options,
                                                            CancelState* cancel) {
  PrepareProcessForClients();
  const std::string socket = options.socket.empty() ? DefaultSocketPath() : options.socket;
  RememberDaemonSocket(socket);
  const std::string from = options.socket.empty() ? "the default path" : "ClientOptions::socket";
  // The daemon may be starting (its socket is there but does not accept yet): connecting is
  // tried until connect_timeout, and so is opening the session. No socket file at all is no
  // daemon: said at once. A server of the wrong uid is refused at once.
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  absl::StatusOr<std::shared_ptr<DaemonConnection>> connection;
  while (true) {
    if (cancel != nullptr && cancel->cancelled()) {
      return absl::CancelledError(
          absl::StrCat("connect to tensorshmd at unix:", socket, ": the wait was cancelled"));
    }
    connection = DaemonConnection::Connect(socket, options.server_uid);
    if (!absl::IsUnavailable(connection.status())) break;
    struct stat file {};
    if (::stat(socket.c_str(), &file) != 0 && (errno == ENOENT || errno == ENOTDIR)) {
      return absl::UnavailableError(absl::StrCat("tensorshmd is not reachable at unix:", socket,
                                                 ": no socket file at that path (is it running? "
                                                 "socket from ",
                                                 from, ")"));
    }
    if (absl::Now() >= deadline) break;
    absl::SleepFor(std::min(kConnectRetry, deadline - absl::Now()));
  }
  if (absl::IsUnavailable(connection.status())) {
    return absl::UnavailableError(absl::StrCat("tensorshmd is not reachable at unix:", socket,
                                               " (is it running? socket from ", from,
                                               "): ", connection.status().message()));
  }
  if (!connection.ok()) return connection.status();
  std::string name = options.client_name;
  if (name.empty()) name = absl::StrCat("pid-", getpid());
  auto core = std::make_shared<ClientCore>(socket, options.server_uid, *std::move(connection),
                                           std::move(name), options.connect_timeout);
  if (absl::Status s = core->OpenSession(deadline, cancel); !s.ok()) return s;
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

std::string Client::session_id() const { return absl::StrCat(core_->session_number()); }

uint64_t Client::daemon_instance() const { return core_->daemon_instance(); }

const std::string& Client::socket() const { return core_->socket(); }

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

absl::Status Client::StreamWaitEvent(int ordinal, CudaStream stream, void* event) {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  return core_->cuda().StreamWaitEvent(ordinal, static_cast<CUstream>(stream),
                                       static_cast<CUevent>(event));
}

absl::StatusOr<WritableTensor> Client::Create(const TensorSpec& spec) {
  return Create(spec, absl::ZeroDuration());
}

absl::StatusOr<WritableTensor> Client::Create(const TensorSpec& spec, absl::Duration timeout) {
  return CreateAcrossRestart(spec, timeout, nullptr);
}

absl::StatusOr<WritableTensor> Client::Create(const TensorSpec& spec, absl::Duration timeout,
                                              const WaitCanceller& cancel) {
  return CreateAcrossRestart(spec, timeout, cancel.state_.get());
}

absl::StatusOr<WritableTensor> Client::CreateAcrossRestart(const TensorSpec& spec,
                                                           absl::Duration timeout,
                                                           CancelState* cancel) {
  // A create the daemon made before it died is freed by it (or its successor, after the grace
  // period): made again on the new session, it costs nothing twice.
  const absl::Time start = absl::Now();
  return core_->CallAcrossRestart(
      "create", ClientCore::RestartDeadline(timeout), /*repeatable=*/true, cancel, [&] {
        absl::Duration left = timeout;
        if (timeout != absl::InfiniteDuration() && timeout > absl::ZeroDuration()) {
          // At least a millisecond: zero would mean "do not wait" to a wait that ran out.
          left = std::max(absl::Milliseconds(1), start + timeout - absl::Now());
        }
        return CreateImpl(spec, left, cancel);
      });
}

absl::StatusOr<WritableTensor> Client::CreateImpl(const TensorSpec& spec, absl::Duration timeout,
                                                  CancelState* cancel) {
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
        tensor.segment_mapping_ = std::move(stocked->buffer.segment);
        tensor.buffer_address_ = stocked->buffer.data;
        tensor.buffer_length_ = stock_length;
        tensor.shape_ = spec.shape;
        tensor.strides_ = std::move(layout->strides);
        tensor.nbytes_ = layout->nbytes;
        tensor.flags_ = spec.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0;
        tensor.tensor_.data = stocked->buffer.data;
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
        // Populated in the background since it was stocked; what is left, now.
        tensor.segment_mapping_->Populate(tensor.buffer_offset_, stock_length);
        // The daemon was not asked for this buffer: it may be asleep when the publish comes.
        core_->ExpectFill(stock_length);
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
  absl::Status created = ChannelOrRpc(*core_, call, &v1::ChannelResponse::mutable_created,
                                      &v1::TensorShm::Stub::Create, request, &response);
  if (absl::IsResourceExhausted(created) && timeout > absl::ZeroDuration()) {
    // The memory channel's creates never wait: the gRPC Create does, in the daemon.
    response.Clear();
    created = CreateWaiting(*core_, request, timeout, cancel, &response);
  }
  if (!created.ok()) return created;
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
    absl::StatusOr<ClientCore::HostBuffer> mapped = core_->MapHostBuffer(location);
    if (!mapped.ok()) return mapped.status();
    tensor.segment_mapping_ = std::move(mapped->segment);
    tensor.buffer_address_ = mapped->data;
    tensor.buffer_length_ = location.length();
    tensor.segment_instance_ = location.segment_instance();
    tensor.segment_id_ = location.segment_id();
    tensor.segment_size_ = location.segment_size();
    tensor.buffer_offset_ = location.offset();
    data = tensor.buffer_address_;
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
    if (tensor.buffer_length_ > 0) {
      absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping =
          core_->MapHostSegment(SegmentKey{tensor.segment_instance_, tensor.segment_id_},
                                tensor.segment_size_, tensor.buffer_offset_, tensor.buffer_length_);
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
    request.set_stock(core_->StockWanted(tensor.buffer_length_));
    request.set_stock_bytes(tensor.buffer_length_);
  }
  if (tensor.tensor_.device.device_type == kDLCUDA) {
    // Acquirers wait for what was issued on the producer's stream up to here.
    absl::StatusOr<std::string> event = core_->cuda().RecordReadyEvent(
        tensor.tensor_.device.device_id, static_cast<CUstream>(ready_stream), tensor.tensor_id_);
    if (!event.ok()) return event.status();
    request.set_ready_event(*std::move(event));
  }
  v1::PublishResponse response;
  // Sent once: a publish whose session ended meanwhile has an unknown fate (CallAcrossRestart).
  if (absl::Status s = core_->CallAcrossRestart(
          absl::StrCat("publish of tensor ", tensor.tensor_id_, " as name = \"", View(name), "\""),
          ClientCore::RestartDeadline(kCallTimeout), /*repeatable=*/false, nullptr,
          [&] {
            // Refused if a restarted daemon did not take the tensor back: its id may name
            // another now.
            if (absl::Status s = core_->UnpublishedId(tensor.key_).status(); !s.ok()) return s;
            return ChannelOrRpc(*core_, call, &v1::ChannelResponse::mutable_published,
                                &v1::TensorShm::Stub::Publish, request, &response);
          });
      !s.ok()) {
    return s;
  }
  core_->AddStock(response.stocked());
  tensor.tensor_.data = nullptr;  // sealed: no writable pointer from here on
  tensor.published_ = true;
  core_->Published(tensor.key_);
  if (tensor.tensor_.device.device_type == kDLCUDA) core_->SweepReadyEvents();
  if (acquired != nullptr) *acquired = std::move(*response.mutable_acquired());
  return absl::OkStatus();
}

namespace {

// AcquireLease, across a daemon restart (ClientCore::CallAcrossRestart): each attempt waits for a
// publish for what is left of `timeout`.
absl::StatusOr<std::unique_ptr<Lease>> AcquireAcrossRestart(const std::shared_ptr<ClientCore>& core,
                                                            std::string_view name,
                                                            absl::Duration timeout, ReadySync sync,
                                                            CancelState* cancel) {
  const absl::Time start = absl::Now();
  return core->CallAcrossRestart(
      absl::StrCat("acquire of name = \"", View(name), "\""), ClientCore::RestartDeadline(timeout),
      /*repeatable=*/true, cancel, [&] {
        absl::Duration left = timeout;
        if (timeout != absl::InfiniteDuration() && timeout > absl::ZeroDuration()) {
          left = std::max(absl::ZeroDuration(), start + timeout - absl::Now());
        }
        return AcquireLease(core, name, left, sync, cancel);
      });
}

}  // namespace

absl::StatusOr<DLManagedTensorVersioned*> Client::Acquire(std::string_view name,
                                                          absl::Duration timeout, ReadySync sync) {
  absl::StatusOr<std::unique_ptr<Lease>> lease =
      AcquireAcrossRestart(core_, name, timeout, sync, nullptr);
  if (!lease.ok()) return lease.status();
  Lease* raw = lease->release();
  raw->versioned.deleter = DeleteVersioned;
  return &raw->versioned;
}

absl::StatusOr<DLManagedTensorVersioned*> Client::Acquire(std::string_view name,
                                                          absl::Duration timeout, ReadySync sync,
                                                          const WaitCanceller& cancel) {
  absl::StatusOr<std::unique_ptr<Lease>> lease =
      AcquireAcrossRestart(core_, name, timeout, sync, cancel.state_.get());
  if (!lease.ok()) return lease.status();
  Lease* raw = lease->release();
  raw->versioned.deleter = DeleteVersioned;
  return &raw->versioned;
}

absl::StatusOr<DLManagedTensorVersioned*> Client::TryAcquireLocal(std::string_view name,
                                                                  absl::Duration wait) {
  absl::StatusOr<std::unique_ptr<Lease>> lease =
      AcquireLease(core_, name, wait, ReadySync::None(), nullptr, /*local_only=*/true);
  if (absl::IsDeadlineExceeded(lease.status())) {
    return absl::NotFoundError(lease.status().message());  // as the contract says: not published
  }
  if (!lease.ok()) return lease.status();
  Lease* raw = lease->release();
  raw->versioned.deleter = DeleteVersioned;
  return &raw->versioned;
}

absl::StatusOr<DLManagedTensor*> Client::AcquireLegacy(std::string_view name,
                                                       absl::Duration timeout, ReadySync sync) {
  absl::StatusOr<std::unique_ptr<Lease>> lease =
      AcquireAcrossRestart(core_, name, timeout, sync, nullptr);
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
  return core_->CallAcrossRestart(
      absl::StrCat("delete of name = \"", View(name), "\""),
      ClientCore::RestartDeadline(kCallTimeout), /*repeatable=*/true, nullptr, [&] {
        return ChannelOrRpc(*core_, call, &v1::ChannelResponse::mutable_deleted,
                            &v1::TensorShm::Stub::Delete, request, &response);
      });
}

absl::StatusOr<std::vector<TensorInfo>> Client::List(std::string_view prefix) {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  if (absl::Status s = ValidateNamePrefix(View(prefix)); !s.ok()) return s;
  v1::ListRequest request;
  request.set_prefix(std::string(prefix));
  v1::ListResponse response;
  if (absl::Status s = core_->CallAcrossRestart(
          "list", ClientCore::RestartDeadline(kCallTimeout), /*repeatable=*/true, nullptr,
          [&] {
            grpc::ClientContext context;
            core_->PrepareContext(context, kCallTimeout);
            return FromGrpcStatus(core_->stub()->List(&context, request, &response));
          });
      !s.ok()) {
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
    out.byte_offset = info.desc().byte_offset();
    out.dlpack_flags = info.desc().flags();
    out.published_unix_ms = info.published_unix_ms();
    out.publisher_uid = info.publisher_uid();
    out.publisher_pid = info.publisher_pid();
  }
  return result;
}

absl::StatusOr<ServerStats> Client::Stat() {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  v1::StatResponse response;
  if (absl::Status s = core_->CallAcrossRestart(
          "stat", ClientCore::RestartDeadline(kCallTimeout), /*repeatable=*/true, nullptr,
          [&] {
            grpc::ClientContext context;
            core_->PrepareContext(context, kCallTimeout);
            return FromGrpcStatus(core_->stub()->Stat(&context, v1::StatRequest(), &response));
          });
      !s.ok()) {
    return s;
  }
  ServerStats stats;
  stats.tensors = response.tensors();
  stats.leases = response.leases();
  stats.sessions = response.sessions();
  stats.names = response.names();
  stats.evicted_tensors = response.evicted_tensors();
  stats.evicted_bytes = response.evicted_bytes();
  stats.creates_waiting = response.creates_waiting();
  stats.stocked_tensors = response.stocked_tensors();
  for (const v1::PoolStats& pool : response.pools()) {
    stats.pools.push_back(PoolStats{FromWire(pool.device()), pool.capacity_bytes(),
                                    pool.used_bytes(), pool.segments(), pool.stock_bytes()});
  }
  return stats;
}

absl::StatusOr<std::vector<SessionInfo>> Client::Sessions() {
  if (absl::Status s = core_->CheckProcess(); !s.ok()) return s;
  v1::SessionsResponse response;
  if (absl::Status s = core_->CallAcrossRestart(
          "sessions", ClientCore::RestartDeadline(kCallTimeout), /*repeatable=*/true, nullptr,
          [&] {
            grpc::ClientContext context;
            core_->PrepareContext(context, kCallTimeout);
            return FromGrpcStatus(
                core_->stub()->Sessions(&context, v1::SessionsRequest(), &response));
          });
      !s.ok()) {
    return s;
  }
  std::vector<SessionInfo> result;
  for (const v1::SessionInfo& info : response.sessions()) {
    SessionInfo& out = result.emplace_back();
    out.session_id = info.session_id();
    out.pid = info.pid();
    out.uid = info.uid();
    out.gid = info.gid();
    out.client_name = info.client_name();
    out.client_version = info.client_version();
    out.rpc_leases = info.rpc_leases();
    out.page_leases = info.page_leases();
    out.unpublished_tensors = info.unpublished_tensors();
    out.unpublished_bytes = info.unpublished_bytes();
    out.waiting_acquires = info.waiting_acquires();
    out.opened_unix_ms = info.opened_unix_ms();
    out.own = info.own();
    out.redacted = info.redacted();
  }
  return result;
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
  segment_mapping_ = std::move(other.segment_mapping_);
  buffer_address_ = other.buffer_address_;
  buffer_length_ = other.buffer_length_;
  nbytes_ = other.nbytes_;
  flags_ = other.flags_;
  published_ = other.published_;
  stocked_ = other.stocked_;
  segment_instance_ = other.segment_instance_;
  segment_id_ = other.segment_id_;
  segment_size_ = other.segment_size_;
  buffer_offset_ = other.buffer_offset_;
  other.buffer_address_ = nullptr;
  other.buffer_length_ = 0;
  other.tensor_ = DLTensor{};
  other.published_ = false;
  return *this;
}

WritableTensor::~WritableTensor() { Reset(); }

void WritableTensor::Reset() {
  tensor_.data = nullptr;
  segment_mapping_.reset();
  buffer_address_ = nullptr;
  buffer_length_ = 0;
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

absl::Status WritableTensor::SealViews() {
  if (!published_) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", tensor_id_, ": SealViews before Publish"));
  }
  if (segment_mapping_ == nullptr || buffer_length_ == 0) return absl::OkStatus();
  return segment_mapping_->Seal(
      static_cast<uint64_t>(static_cast<char*>(buffer_address_) - segment_mapping_->address()),
      buffer_length_);
}

}  // namespace tensorshm
