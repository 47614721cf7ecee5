// Conversions between the wire messages and DLPack values, shared by daemon and clients.
#ifndef TENSORSHM_COMMON_TENSOR_WIRE_H_
#define TENSORSHM_COMMON_TENSOR_WIRE_H_

#include <dlpack/dlpack.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

void ToWire(const DLDataType& dtype, v1::DataType* out);
void ToWire(const DLDevice& device, v1::Device* out);

// Validated conversions (see MakeDataType); INVALID_ARGUMENT naming `field`.
absl::StatusOr<DLDataType> FromWire(const v1::DataType& dtype, absl::string_view field = "dtype");
DLDevice FromWire(const v1::Device& device);

// "cpu", "cuda:1", or "device(type=..,id=..)".
std::string DeviceName(const DLDevice& device);

// A descriptor and location a client may build a DLTensor from: the dtype is valid, the shape
// and strides have the layout the descriptor claims (nbytes, byte_offset), and the location
// covers nbytes. Returns INVALID_ARGUMENT naming the field otherwise; clients refuse such
// descriptors rather than trust them.
struct DecodedTensor {
  DLDataType dtype{};
  DLDevice device{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  uint64_t byte_offset = 0;
  int64_t nbytes = 0;
  uint64_t flags = 0;  // DLPack flags of the storage (IS_SUBBYTE_TYPE_PADDED or 0)
};
absl::StatusOr<DecodedTensor> DecodeDescriptor(const v1::TensorDesc& desc,
                                               const v1::Location& location);
// The other way: the descriptor the daemon sends for a tensor it describes as `tensor`.
void ToWire(const DecodedTensor& tensor, v1::TensorDesc* out);

// Most bytes of each string a client supplies that the daemon keeps for the life of a session
// (SessionOpen.client_name, SessionOpen.client_version).
inline constexpr size_t kMaxClientText = 256;

// OK if `open`'s strings fit kMaxClientText; INVALID_ARGUMENT naming the first field that does
// not ("open.client_name") and its length otherwise. The daemon refuses such a session before
// it keeps anything of it.
absl::Status ValidateSessionOpen(const v1::SessionOpen& open);
// The same check of the two strings themselves.
absl::Status ValidateClientText(const std::string& client_name, const std::string& client_version);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_TENSOR_WIRE_H_
