// What a session's calls on tensors bring to the Store and get back from it, in the daemon's own
// terms: create, publish, acquire, and the memory channel's requests. The gRPC service and the
// channel handler read them from the messages and write them back (server/rpc/wire_calls.h; the
// .proto says what each field means).
#ifndef TENSORSHM_SERVER_CORE_TENSOR_CALLS_H_
#define TENSORSHM_SERVER_CORE_TENSOR_CALLS_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "common/base/unique_fd.h"
#include "common/tensor/layout.h"
#include "server/core/session_calls.h"

namespace tensorshm {

// Where a CUDA tensor's bytes lie (Location.cuda).
struct CudaPlace {
  int32_t ordinal = 0;        // the daemon's ordinal of the device
  std::string uuid{};         // 16 bytes
  bool vmm = false;           // the segment's descriptor comes over the memory channel
  std::string ipc_handle{};   // a CUipcMemHandle; empty for VMM segments and empty tensors
  std::string ready_event{};  // a CUipcEventHandle, once published with one
};

// Where a tensor's bytes lie (Location): a span of one segment.
struct TensorPlace {
  uint64_t segment_id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t segment_size = 0;
  uint64_t segment_instance = 0;
  std::optional<std::string> shm_name{};  // a host segment's name ("" for memfd); set on the host
  std::optional<CudaPlace> cuda{};        // set for CUDA tensors
};

// What a create asks for, or a publish reinterprets a buffer as: dtype, shape and strides.
struct TensorSpec {
  DLDataType dtype{};
  std::vector<int64_t> shape{};
  std::vector<int64_t> strides{};  // empty: C-contiguous
  bool subbyte_padded = false;
};

// A create (CreateRequest).
struct CreateOrder {
  TensorSpec spec{};
  DLDevice device{kDLCPU, 0};
  std::string device_uuid{};  // empty, or the CUDA device's 16-byte uuid
  uint32_t stock = 0;
  int64_t wait_ms = 0;
  uint64_t request_id = 0;  // 0: none
};

// An unpublished uint8 buffer made ahead of the session's need (StockedBuffer).
struct Stocked {
  uint64_t tensor_id = 0;
  TensorPlace place{};
};

// A create's answer (CreateResponse).
struct Created {
  uint64_t tensor_id = 0;
  DecodedTensor desc{};
  TensorPlace place{};
  std::vector<Stocked> stocked{};
};

// An acquire (AcquireRequest).
struct AcquireOrder {
  std::string name{};
  int64_t wait_ms = 0;
  uint64_t request_id = 0;  // 0: none
};

// A lease, as an acquire answers it (AcquireResponse).
struct LeaseGrant {
  uint64_t lease_id = 0;
  uint64_t tensor_id = 0;
  DecodedTensor desc{};
  TensorPlace place{};
};

// A publish (PublishRequest).
struct PublishOrder {
  uint64_t tensor_id = 0;
  std::string name{};
  bool replace = false;
  bool acquire = false;
  std::string ready_event{};         // empty, or a CUipcEventHandle
  std::optional<TensorSpec> spec{};  // set: the buffer is published with this dtype and shape
  uint32_t stock = 0;
  uint64_t stock_bytes = 0;
};

// A publish's answer (PublishResponse).
struct Published {
  std::optional<LeaseGrant> acquired{};  // set when the order asked to acquire
  std::vector<Stocked> stocked{};
};

// ---- The memory channel's requests (ChannelRequest) and answers (ChannelResponse) ----

struct ChannelBind {
  std::string session_token{};
};
struct ChannelBound {
  uint64_t instance_id = 0;
};

// A segment's descriptor (SegmentRequest): a host segment, or a VMM CUDA segment.
struct SegmentAsk {
  uint64_t segment_id = 0;
  uint64_t segment_instance = 0;
  bool writable = false;
  bool cuda = false;
  int32_t device_ordinal = 0;  // with cuda
};
struct SegmentGranted {
  uint64_t segment_id = 0;
  uint64_t segment_instance = 0;
  uint64_t size = 0;
  bool writable = false;
  std::string shm_name{};    // host; "" for memfd
  uint64_t granularity = 0;  // CUDA
};

// A fast path part's descriptor (FastPathRequest.Part's values).
enum class FastPathPart : int32_t { kIndex = 1, kRecords = 2, kLeasePage = 3 };
struct FastPathAsk {
  int32_t part = 0;  // a FastPathPart, unchecked
};
struct FastPathGranted {
  FastPathPart part = FastPathPart::kIndex;
  uint64_t size = 0;
  uint64_t instance_id = 0;
};

struct DeleteOrder {
  std::string name{};
};
struct Deleted {};

// A channel create's answer: the segment its buffer lies in comes along when the session has not
// been granted it yet (ChannelResponse.attached_segment).
struct ChannelCreated {
  Created created{};
  std::optional<SegmentGranted> attached{};
};

using ChannelAsk = std::variant<ChannelBind, SegmentAsk, FastPathAsk, CreateOrder, PublishOrder,
                                DeleteOrder, AcquireOrder, Releases>;
using ChannelAnswer = std::variant<ChannelBound, SegmentGranted, FastPathGranted, ChannelCreated,
                                   Published, Deleted, LeaseGrant, ReleasesDone>;

// A channel request's answer, and the descriptor it brings (none: -1).
struct ChannelReplied {
  ChannelAnswer answer{};
  UniqueFd fd{};
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_TENSOR_CALLS_H_
