// Tests compare status codes of two kinds: the public API's (tensorshm::StatusCode, from
// client.h) and the library's internals' (absl::StatusCode, from the daemon's and the client's
// own classes). Both are gRPC's canonical codes with the same values (tensorshm/status.h), so a
// test may compare either with either: EXPECT_EQ(client->Delete("x").code(),
// absl::StatusCode::kNotFound) reads the same as with tensorshm::StatusCode::kNotFound.
#ifndef TENSORSHM_TESTS_SUPPORT_STATUS_CODES_H_
#define TENSORSHM_TESTS_SUPPORT_STATUS_CODES_H_

#include "absl/status/status.h"
#include "tensorshm/status.h"

namespace tensorshm {

// C++20 derives b == a and != from it.
inline bool operator==(StatusCode a, absl::StatusCode b) {
  return static_cast<int>(a) == static_cast<int>(b);
}

}  // namespace tensorshm

#endif  // TENSORSHM_TESTS_SUPPORT_STATUS_CODES_H_
