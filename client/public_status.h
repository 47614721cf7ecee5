// Between the library's abseil types and the public ones of include/tensorshm/status.h. The
// library works in absl::Status and absl::Duration inside; only the Client's public methods
// convert, as they return. Private to the client library.
#ifndef TENSORSHM_CLIENT_PUBLIC_STATUS_H_
#define TENSORSHM_CLIENT_PUBLIC_STATUS_H_

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tensorshm/status.h"

namespace tensorshm {

// Both code sets are gRPC's canonical codes, value for value.
inline Status ToPublic(const absl::Status& status) {
  if (status.ok()) return Status();  // every successful call: no message to copy
  return Status(static_cast<StatusCode>(status.code()), std::string(status.message()));
}

template <typename T>
StatusOr<T> ToPublic(absl::StatusOr<T>&& result) {
  if (!result.ok()) return ToPublic(result.status());
  return StatusOr<T>(std::move(*result));
}

inline absl::Status ToAbsl(const Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.code()), status.message());
}

// kForever (or anything as long) waits without end; zero or less does not wait.
inline absl::Duration ToAbsl(Duration duration) {
  if (duration == kForever) return absl::InfiniteDuration();
  if (duration <= Duration::zero()) return absl::ZeroDuration();
  return absl::Nanoseconds(duration.count());
}

// The other way: absl::InfiniteDuration() (or anything past kForever) is kForever.
inline Duration ToChrono(absl::Duration duration) {
  if (duration >= absl::Nanoseconds(kForever.count())) return kForever;
  if (duration <= absl::ZeroDuration()) return Duration::zero();
  return absl::ToChronoNanoseconds(duration);
}

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_PUBLIC_STATUS_H_
