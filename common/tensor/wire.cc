#include "common/tensor/wire.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/tensor/dtype.h"
#include "common/tensor/layout.h"

namespace tensorshm {

void ToWire(const DLDataType& dtype, v1::DataType* out) {
  out->set_code(dtype.code);
  out->set_bits(dtype.bits);
  out->set_lanes(dtype.lanes);
}

void ToWire(const DLDevice& device, v1::Device* out) {
  out->set_type(device.device_type);
  out->set_id(device.device_id);
}

void ToWire(const DecodedTensor& tensor, v1::TensorDesc* out) {
  ToWire(tensor.dtype, out->mutable_dtype());
  ToWire(tensor.device, out->mutable_device());
  out->mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
  out->mutable_strides()->Assign(tensor.strides.begin(), tensor.strides.end());
  out->set_byte_offset(tensor.byte_offset);
  out->set_nbytes(tensor.nbytes);
  out->set_flags(tensor.flags);
}

absl::StatusOr<DLDataType> FromWire(const v1::DataType& dtype, absl::string_view field) {
  return MakeDataType(dtype.code(), dtype.bits(), dtype.lanes(), field);
}

DLDevice FromWire(const v1::Device& device) {
  return DLDevice{static_cast<DLDeviceType>(device.type()), device.id()};
}

absl::StatusOr<DecodedTensor> DecodeDescriptor(const v1::TensorDesc& desc,
                                               const v1::Location& location) {
  DecodedTensor out;
  absl::StatusOr<DLDataType> dtype = FromWire(desc.dtype(), "desc.dtype");
  if (!dtype.ok()) return dtype.status();
  out.dtype = *dtype;
  out.device = FromWire(desc.device());
  out.shape.assign(desc.shape().begin(), desc.shape().end());
  out.strides.assign(desc.strides().begin(), desc.strides().end());
  if ((desc.flags() & ~uint64_t{DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED}) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("desc.flags = ", desc.flags(), ": unknown flag bits"));
  }
  out.flags = desc.flags();
  absl::StatusOr<TensorLayout> layout =
      ComputeLayout(out.dtype, out.shape, out.strides,
                    (out.flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0);
  if (!layout.ok()) return layout.status();
  if (layout->nbytes != desc.nbytes() || layout->byte_offset != desc.byte_offset()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "desc: nbytes = ", desc.nbytes(), ", byte_offset = ", desc.byte_offset(),
        " disagree with the shape and strides (", layout->nbytes, ", ", layout->byte_offset, ")"));
  }
  if (static_cast<uint64_t>(layout->nbytes) > location.length()) {
    return absl::InvalidArgumentError(absl::StrCat("location.length = ", location.length(),
                                                   ": smaller than the tensor's ", layout->nbytes,
                                                   " bytes"));
  }
  if (location.length() > 0 && (location.offset() > location.segment_size() ||
                                location.length() > location.segment_size() - location.offset())) {
    return absl::InvalidArgumentError(absl::StrCat("location: [", location.offset(), ", +",
                                                   location.length(), ") exceeds segment size ",
                                                   location.segment_size()));
  }
  out.strides = std::move(layout->strides);
  out.byte_offset = layout->byte_offset;
  out.nbytes = layout->nbytes;
  return out;
}

absl::Status ValidateSessionOpen(const v1::SessionOpen& open) {
  return ValidateClientText(open.client_name(), open.client_version());
}

}  // namespace tensorshm
