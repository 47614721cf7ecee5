// tensorshm's own result types for the C++ API (client.h): Status, StatusOr<T> and the Duration
// a wait takes. They are the library's ABI: no type of another library crosses it, so that a
// program built against one release of libtensorshm keeps working with the next one of the same
// soname, whatever the libraries the daemon and the client are built with.
//
// The codes are gRPC's canonical ones, with the same values: a code read over gRPC, from
// Python's exceptions or from the C API (tsm_status) means the same thing here.
#ifndef TENSORSHM_STATUS_H_
#define TENSORSHM_STATUS_H_

#include <chrono>
#include <exception>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "tensorshm/export.h"

namespace tensorshm {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// "NOT_FOUND" for kNotFound, as gRPC spells the codes; "UNKNOWN_CODE" for a value not listed.
TENSORSHM_EXPORT std::string_view StatusCodeName(StatusCode code);

// What a call did: OK, or a code and a message that names what was wrong. A call's Status must
// be looked at (or dropped with IgnoreError()).
class [[nodiscard]] TENSORSHM_EXPORT Status {
 public:
  Status() = default;  // OK
  // An OK code drops the message.
  Status(StatusCode code, std::string message);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "OK", or "NOT_FOUND: the message".
  std::string ToString() const;
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

TENSORSHM_EXPORT std::ostream& operator<<(std::ostream& out, const Status& status);
TENSORSHM_EXPORT std::ostream& operator<<(std::ostream& out, StatusCode code);

// Thrown by StatusOr::value() (and *, ->) on a StatusOr that holds an error.
class TENSORSHM_EXPORT BadStatusOrAccess : public std::exception {
 public:
  explicit BadStatusOrAccess(Status status);
  ~BadStatusOrAccess() override;
  const char* what() const noexcept override;
  const Status& status() const { return status_; }

 private:
  Status status_;
  std::string what_;
};

// Throws BadStatusOrAccess(status), for StatusOr. Out of line, so that the exception's type
// information and vtable are referred to from the library alone, not from code inlined into its
// users (whose executables would need text relocations for them).
TENSORSHM_EXPORT [[noreturn]] void ThrowBadStatusOrAccess(const Status& status);

// A T, or the Status saying why there is none (never OK).
template <typename T>
class [[nodiscard]] StatusOr {
  static_assert(!std::is_same_v<std::remove_cv_t<T>, Status>, "StatusOr<Status> means nothing");

 public:
  // UNKNOWN, as a result not yet assigned.
  StatusOr() : status_(StatusCode::kUnknown, "StatusOr holds no value yet") {}
  StatusOr(const T& value) : value_(value) {}        // NOLINT: implicit, as a return value
  StatusOr(T&& value) : value_(std::move(value)) {}  // NOLINT
  // An OK `status` holds no value: it becomes INTERNAL.
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = Status(StatusCode::kInternal, "StatusOr made from an OK Status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  T& value() & {
    Check();
    return *value_;
  }
  const T& value() const& {
    Check();
    return *value_;
  }
  T&& value() && {
    Check();
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& {
    return ok() ? *value_ : static_cast<T>(std::forward<U>(fallback));
  }
  template <typename U>
  T value_or(U&& fallback) && {
    return ok() ? std::move(*value_) : static_cast<T>(std::forward<U>(fallback));
  }
  void IgnoreError() const {}

 private:
  void Check() const {
    if (!value_.has_value()) ThrowBadStatusOrAccess(status_);
  }

  Status status_;  // OK while value_ holds a value
  std::optional<T> value_;
};

// How long a call waits. Any std::chrono duration of whole units converts to it
// (std::chrono::seconds(5), 250ms). Zero or less: the call does not wait. Nanoseconds hold about
// 292 years: for longer, or without end, pass kForever (std::chrono::hours::max() would overflow
// in the conversion).
using Duration = std::chrono::nanoseconds;
// Waits without end.
inline constexpr Duration kForever = Duration::max();

}  // namespace tensorshm

#endif  // TENSORSHM_STATUS_H_
