// Conversions between the wire messages and DLPack values, shared by daemon and clients.
#ifndef TENSORSHM_COMMON_TENSOR_WIRE_H_
#define TENSORSHM_COMMON_TENSOR_WIRE_H_

#include <dlpack/dlpack.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tensor/layout.h"
#include "common/tensor/name.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

void ToWire(const DLDataType& dtype, v1::DataType* out);
void ToWire(const DLDevice& device, v1::Device* out);

// Validated conversions (see MakeDataType); INVALID_ARGUMENT naming `field`.
absl::StatusOr<DLDataType> FromWire(const v1::DataType& dtype, absl::string_view field = "dtype");
DLDevice FromWire(const v1::Device& device);

// A descriptor and location a client may build a DLTensor from (a DecodedTensor, layout.h): the
// dtype is valid, the shape and strides have the layout the descriptor claims (nbytes,
// byte_offset), and the location covers nbytes. Returns INVALID_ARGUMENT naming the field
// otherwise; clients refuse such descriptors rather than trust them.
absl::StatusOr<DecodedTensor> DecodeDescriptor(const v1::TensorDesc& desc,
                                               const v1::Location& location);
// The other way: the descriptor the daemon sends for a tensor it describes as `tensor`.
void ToWire(const DecodedTensor& tensor, v1::TensorDesc* out);

// OK if `open`'s strings fit kMaxClientText; INVALID_ARGUMENT naming the first field that does
// not ("open.client_name") and its length otherwise. The daemon refuses such a session before
// it keeps anything of it.
absl::Status ValidateSessionOpen(const v1::SessionOpen& open);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_TENSOR_WIRE_H_
