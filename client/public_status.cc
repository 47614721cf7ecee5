#include <ostream>
#include <string>
#include <string_view>
#include <utility>

#include "tensorshm/status.h"

// The public Status (include/tensorshm/status.h): what its header does not define inline.
namespace tensorshm {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kCancelled:
      return "CANCELLED";
    case StatusCode::kUnknown:
      return "UNKNOWN";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound:
      return "NOT_FOUND";
    case StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case StatusCode::kAborted:
      return "ABORTED";
    case StatusCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case StatusCode::kInternal:
      return "INTERNAL";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case StatusCode::kDataLoss:
      return "DATA_LOSS";
    case StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
  }
  return "UNKNOWN_CODE";
}

Status::Status(StatusCode code, std::string message) : code_(code) {
  if (code_ != StatusCode::kOk) message_ = std::move(message);
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string text(StatusCodeName(code_));
  if (!message_.empty()) text.append(": ").append(message_);
  return text;
}

std::ostream& operator<<(std::ostream& out, const Status& status) {
  return out << status.ToString();
}

std::ostream& operator<<(std::ostream& out, StatusCode code) { return out << StatusCodeName(code); }

BadStatusOrAccess::BadStatusOrAccess(Status status)
    : status_(std::move(status)), what_("StatusOr::value() of an error: " + status_.ToString()) {}

BadStatusOrAccess::~BadStatusOrAccess() = default;

const char* BadStatusOrAccess::what() const noexcept { return what_.c_str(); }

void ThrowBadStatusOrAccess(const Status& status) { throw BadStatusOrAccess(status); }

}  // namespace tensorshm
