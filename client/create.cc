// Client's creates: from this client's stock, else by the daemon (over the memory channel, or a
// gRPC call that waits for memory), across restarts.
#include <grpcpp/client_context.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/calls.h"
#include "client/cancel.h"
#include "client/client_access.h"
#include "client/client_core.h"
#include "client/lease.h"
#include "client/public_status.h"
#include "client/writable_tensor.h"
#include "common/tensor/grpc_status.h"
#include "common/tensor/layout.h"
#include "common/tensor/wire.h"
#include "tensorshm/client.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {
namespace {

// The gRPC Create of `request` (its wait_ms and request_id set, if it waits), for when the memory
// channel cannot be had.
absl::Status CreateByRpc(ClientCore& core, const v1::CreateRequest& request, absl::Duration timeout,
                         CancelState* cancel, v1::CreateResponse* response) {
  grpc::ClientContext context;
  // A wait's deadline leaves room for the daemon to answer RESOURCE_EXHAUSTED itself.
  const std::string session = core.PrepareContext(
      context, timeout == absl::InfiniteDuration() ? timeout : timeout + kCallTimeout);
  ScopedWait wait(cancel, CancelState::Wait{.context = &context});
  if (!wait.registered()) return Cancelled("create");
  absl::Status s = FromGrpcStatus(core.stub()->Create(&context, request, response));
  if (!s.ok() && request.request_id() != 0 && MayHaveBeenGranted(s, context)) {
    core.QueueSettle(session, request.request_id());
  }
  if (absl::IsCancelled(s) && cancel != nullptr && cancel->cancelled()) return Cancelled("create");
  return s;
}

// The daemon's create of `call` (holding `request`), over the memory channel: answered at once,
// or once the daemon has grown the pool or, with a `timeout` (> 0; infinite: until it is served),
// found the memory. Only when the channel cannot be had, by the gRPC Create.
absl::Status CreateByDaemon(ClientCore& core, v1::ChannelRequest& call, absl::Duration timeout,
                            CancelState* cancel, v1::CreateResponse* response) {
  v1::CreateRequest& request = *call.mutable_create();
  if (timeout > absl::ZeroDuration()) {
    // As an acquire's: a create whose answer this client does not take is settled (its buffers
    // freed) by the daemon.
    request.set_request_id(core.NextRequestId());
    request.set_wait_ms(timeout == absl::InfiniteDuration()
                            ? -1
                            : std::max<int64_t>(1, absl::ToInt64Milliseconds(absl::Ceil(
                                                       timeout, absl::Milliseconds(1)))));
  }
  const std::string session = core.session_id();
  absl::StatusOr<v1::ChannelResponse> answer =
      core.Exchange(call, timeout > absl::ZeroDuration() ? timeout : absl::ZeroDuration(), cancel);
  if (answer.ok()) {
    *response = std::move(*answer->mutable_created());
    return absl::OkStatus();
  }
  const absl::Status& s = answer.status();
  if (ChannelNotHad(s)) {
    // The channel cannot be had (no daemon saw the request).
    return CreateByRpc(core, request, timeout, cancel, response);
  }
  if (SentWithoutAnswer(s) && request.request_id() != 0) {
    core.QueueSettle(session, request.request_id());
  }
  if (absl::IsCancelled(s) && cancel != nullptr && cancel->cancelled()) return Cancelled("create");
  return s;
}

// One create on the current session.
absl::StatusOr<WritableTensor> CreateOnce(const std::shared_ptr<ClientCore>& core,
                                          const TensorSpec& spec, absl::Duration timeout,
                                          CancelState* cancel) {
  if (absl::Status s = core->CheckProcess(); !s.ok()) return s;
  // A host tensor whose buffer length is in stock is made here, without asking the daemon.
  uint64_t stock_length = 0;
  if (spec.device.device_type == kDLCPU && spec.device.device_id == 0) {
    absl::StatusOr<TensorLayout> layout =
        ComputeLayout(spec.dtype, spec.shape, spec.strides, spec.subbyte_padded);
    if (layout.ok() && layout->nbytes > 0) {
      const uint64_t page = static_cast<uint64_t>(getpagesize());
      stock_length = (layout->byte_offset + layout->nbytes + page - 1) / page * page;
      core->stock().NoteCreate(stock_length);
      if (std::optional<StockShelf::Stocked> stocked = core->stock().Take(stock_length)) {
        auto tensor = std::make_unique<WritableTensorState>();
        tensor->core = core;
        tensor->tensor_id = stocked->tensor_id;
        tensor->key = core->AddUnpublished(stocked->tensor_id);
        tensor->stocked = true;
        tensor->SetHostBuffer(stocked->buffer, stocked->location);
        tensor->SetTensor(stocked->buffer.data, spec.device, spec.dtype, spec.shape,
                          std::move(layout->strides), layout->byte_offset, layout->nbytes,
                          spec.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0);
        // Populated in the background since it was stocked; what is left, now.
        tensor->segment_mapping->Populate(tensor->buffer_offset, stock_length);
        // The daemon was not asked for this buffer: it may be asleep when the publish comes.
        core->ExpectFill(stock_length);
        return WritableTensorState::Wrap(std::move(tensor));
      }
    }
  }
  v1::ChannelRequest call;
  v1::CreateRequest& request = *call.mutable_create();
  request.set_stock(core->stock().Wanted(stock_length));
  ToWire(spec.dtype, request.mutable_dtype());
  request.mutable_shape()->Assign(spec.shape.begin(), spec.shape.end());
  request.mutable_strides()->Assign(spec.strides.begin(), spec.strides.end());
  ToWire(spec.device, request.mutable_device());
  request.set_subbyte_padded(spec.subbyte_padded);
  if (spec.device.device_type == kDLCUDA) {
    // The daemon numbers devices its own way: the UUID names the device.
    absl::StatusOr<std::string> uuid = core->cuda().UuidOf(spec.device.device_id);
    if (!uuid.ok()) return uuid.status();
    request.set_device_uuid(*std::move(uuid));
  }
  v1::CreateResponse response;
  if (absl::Status created = CreateByDaemon(*core, call, timeout, cancel, &response);
      !created.ok()) {
    return created;
  }
  core->AddStock(response.stocked());
  auto state = std::make_unique<WritableTensorState>();
  state->core = core;
  state->tensor_id = response.tensor_id();
  state->key = core->AddUnpublished(state->tensor_id);
  WritableTensorState& tensor = *state;
  // From here on the WritableTensor's destructor gives the buffer back if anything fails.
  WritableTensor writable = WritableTensorState::Wrap(std::move(state));
  absl::StatusOr<DecodedTensor> decoded = DecodeDescriptor(response.desc(), response.location());
  if (!decoded.ok()) {
    return absl::InternalError(
        absl::StrCat("tensorshmd sent a bad descriptor: ", decoded.status().message()));
  }
  const v1::Location& location = response.location();
  void* data = const_cast<char*>(kEmptyData);
  if (location.has_cuda()) {
    absl::StatusOr<CudaBuffer> buffer = OpenCudaLocation(*core, location);
    if (!buffer.ok()) return buffer.status();
    decoded->device.device_id = buffer->ordinal;
    data = buffer->data;
    tensor.cuda_place = PlaceFrom(location, buffer->data);
    if (location.cuda().vmm() && location.length() > 0) {
      // Mapped read-only like every VMM segment: this buffer's pieces are writable here until
      // its publish.
      if (absl::Status s = core->cuda().MakeWritable(
              buffer->ordinal, SegmentKey{location.segment_instance(), location.segment_id()},
              location.offset(), location.length());
          !s.ok()) {
        return s;
      }
      tensor.cuda_writable = true;
      tensor.cuda_ordinal = buffer->ordinal;
      tensor.cuda_length = location.length();
    }
  } else if (location.length() > 0) {
    absl::StatusOr<HostBuffer> mapped = core->mappings().Buffer(location);
    if (!mapped.ok()) return mapped.status();
    tensor.SetHostBuffer(*mapped, location);
    data = mapped->data;
  }
  tensor.SetTensor(data, decoded->device, decoded->dtype, std::move(decoded->shape),
                   std::move(decoded->strides), decoded->byte_offset, decoded->nbytes,
                   decoded->flags);
  return writable;
}

// CreateOnce, run again on the new session when a daemon restart ended the old one.
absl::StatusOr<WritableTensor> CreateAcrossRestart(const std::shared_ptr<ClientCore>& core,
                                                   const TensorSpec& spec, absl::Duration timeout,
                                                   CancelState* cancel) {
  // A create the daemon made before it died is freed by it (or its successor, after the grace
  // period): made again on the new session, it costs nothing twice.
  const absl::Time start = absl::Now();
  return core->CallAcrossRestart(
      "create", ClientCore::RestartDeadline(timeout), /*repeatable=*/true, cancel, [&] {
        absl::Duration left = timeout;
        if (timeout != absl::InfiniteDuration() && timeout > absl::ZeroDuration()) {
          // At least a millisecond: zero would mean "do not wait" to a wait that ran out.
          left = std::max(absl::Milliseconds(1), start + timeout - absl::Now());
        }
        return CreateOnce(core, spec, left, cancel);
      });
}

}  // namespace

StatusOr<WritableTensor> Client::Create(const TensorSpec& spec) {
  return Create(spec, Duration::zero());
}

StatusOr<WritableTensor> Client::Create(const TensorSpec& spec, Duration timeout) {
  return ToPublic(CreateAcrossRestart(core_, spec, ToAbsl(timeout), nullptr));
}

StatusOr<WritableTensor> Client::Create(const TensorSpec& spec, Duration timeout,
                                        const WaitCanceller& cancel) {
  return ToPublic(CreateAcrossRestart(core_, spec, ToAbsl(timeout), ClientAccess::State(cancel)));
}

}  // namespace tensorshm
