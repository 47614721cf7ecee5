// libFuzzer target over what the daemon and clients trust least: request validation (names,
// prefixes, dtypes, shapes, strides, sizes, the strings of a session's opening) and the decoding
// of descriptors a client receives.
// The first byte picks the input's kind; the rest is a serialized message or raw text.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/base/check.h"
#include "common/tensor/dtype.h"
#include "common/tensor/layout.h"
#include "common/tensor/name.h"
#include "common/tensor/wire.h"
#include "google/protobuf/stubs/logging.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {
namespace {

void FuzzCreate(const std::string& bytes) {
  v1::CreateRequest request;
  if (!request.ParseFromString(bytes)) return;
  absl::StatusOr<DLDataType> dtype = FromWire(request.dtype());
  if (!dtype.ok()) return;
  std::vector<int64_t> shape(request.shape().begin(), request.shape().end());
  std::vector<int64_t> strides(request.strides().begin(), request.strides().end());
  absl::StatusOr<TensorLayout> layout =
      ComputeLayout(*dtype, shape, strides, request.subbyte_padded());
  if (!layout.ok()) {
    TSM_CHECK(layout.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  // A valid layout is self-consistent: every stride is resolved and the extent is non-negative.
  TSM_CHECK(layout->strides.size() == shape.size());
  TSM_CHECK(layout->nbytes >= 0);
  TSM_CHECK(layout->byte_offset <= static_cast<uint64_t>(layout->nbytes));
  // What the shape describes (broadcast strides included) can be sized without overflow.
  int64_t numel = 1;
  for (int64_t d : shape) TSM_CHECK(!__builtin_mul_overflow(numel, d, &numel));
  int64_t logical = 0;
  TSM_CHECK(!__builtin_mul_overflow(numel, (ElementBits(*dtype) + 7) / 8, &logical));
}

void FuzzDescriptor(const std::string& bytes) {
  v1::AcquireResponse response;
  if (!response.ParseFromString(bytes)) return;
  absl::StatusOr<DecodedTensor> decoded = DecodeDescriptor(response.desc(), response.location());
  if (!decoded.ok()) return;
  // Whatever a client accepts lies inside the location it maps.
  TSM_CHECK(static_cast<uint64_t>(decoded->nbytes) <= response.location().length());
  if (response.location().length() > 0) {
    TSM_CHECK(response.location().offset() + response.location().length() <=
              response.location().segment_size());
  }
}

void FuzzSessionOpen(const std::string& bytes) {
  v1::SessionOpen open;
  if (!open.ParseFromString(bytes)) return;
  const absl::Status status = ValidateSessionOpen(open);
  // Refused exactly when a string the daemon would keep is over the bound, naming that field.
  const bool fits =
      open.client_name().size() <= kMaxClientText && open.client_version().size() <= kMaxClientText;
  TSM_CHECK(status.ok() == fits);
  if (!status.ok()) {
    TSM_CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    TSM_CHECK(absl::StrContains(status.message(), "open.client_"));
  }
}

void FuzzText(const std::string& text) {
  const absl::Status name = ValidateName(text);
  if (name.ok()) {
    TSM_CHECK(!text.empty() && text.size() <= kMaxNameLength && text[0] != '/');
  }
  (void)ValidateNamePrefix(text);
  absl::StatusOr<DLDataType> dtype = ParseDataType(text);
  if (dtype.ok()) TSM_CHECK(ParseDataType(DataTypeName(*dtype)).ok());
}

}  // namespace
}  // namespace tensorshm

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Malformed strings are expected here; protobuf's log lines about them are noise.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      tensorshm::FuzzCreate(rest);
      break;
    case 1:
      tensorshm::FuzzDescriptor(rest);
      break;
    case 3:
      tensorshm::FuzzSessionOpen(rest);
      break;
    default:
      tensorshm::FuzzText(rest);
      break;
  }
  return 0;
}
