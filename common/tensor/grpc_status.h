// Conversion between absl::Status and grpc::Status. Their codes are the same canonical codes,
// so each side converts with one function.
#ifndef TENSORSHM_COMMON_TENSOR_GRPC_STATUS_H_
#define TENSORSHM_COMMON_TENSOR_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace tensorshm {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_TENSOR_GRPC_STATUS_H_
