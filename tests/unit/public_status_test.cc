// The public result types of include/tensorshm/status.h, through libtensorshm.so as a user links
// it: codes equal to gRPC's (and so to the library's internal absl ones), BadStatusOrAccess
// thrown across the library's boundary, and the conversions the Client's methods make.
#include "client/public_status.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "tensorshm/client.h"
#include "tensorshm/status.h"

namespace tensorshm {
namespace {

TEST(PublicStatusTest, EveryCodeHasGrpcsValueAndName) {
  for (int value = 0; value <= 16; ++value) {
    const auto code = static_cast<StatusCode>(value);
    const auto internal = static_cast<absl::StatusCode>(value);
    EXPECT_EQ(StatusCodeName(code), absl::StatusCodeToString(internal)) << value;
    EXPECT_NE(StatusCodeName(code), "UNKNOWN_CODE") << value;
  }
  EXPECT_EQ(static_cast<int>(StatusCode::kNotFound), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_EQ(static_cast<int>(StatusCode::kUnauthenticated), 16);
  EXPECT_EQ(StatusCodeName(static_cast<StatusCode>(99)), "UNKNOWN_CODE");
}

TEST(PublicStatusTest, StatusSaysItsCodeAndMessage) {
  const Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.ToString(), "OK");
  EXPECT_EQ(Status(StatusCode::kOk, "dropped").message(), "");
  const Status missing(StatusCode::kNotFound, "name = \"x\": not published");
  EXPECT_FALSE(missing.ok());
  EXPECT_EQ(missing.ToString(), "NOT_FOUND: name = \"x\": not published");
  std::ostringstream out;
  out << missing << " " << StatusCode::kDataLoss;
  EXPECT_EQ(out.str(), "NOT_FOUND: name = \"x\": not published DATA_LOSS");
  EXPECT_EQ(missing, Status(StatusCode::kNotFound, "name = \"x\": not published"));
  EXPECT_FALSE(missing == Status(StatusCode::kNotFound, "other"));
}

TEST(PublicStatusTest, StatusOrHoldsAValueOrAnError) {
  StatusOr<std::unique_ptr<int>> value = std::make_unique<int>(7);
  ASSERT_TRUE(value.ok());
  EXPECT_TRUE(value.status().ok());
  EXPECT_EQ(**value, 7);
  std::unique_ptr<int> taken = *std::move(value);
  EXPECT_EQ(*taken, 7);

  StatusOr<int> error = Status(StatusCode::kDeadlineExceeded, "late");
  EXPECT_FALSE(error.ok());
  EXPECT_EQ(error.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(error.value_or(3), 3);

  // An OK status holds no value: INTERNAL. Not yet assigned: UNKNOWN.
  EXPECT_EQ(StatusOr<int>(Status()).status().code(), StatusCode::kInternal);
  EXPECT_EQ(StatusOr<int>().status().code(), StatusCode::kUnknown);
}

TEST(PublicStatusTest, ValueOfAnErrorThrowsBadStatusOrAccessAcrossTheLibrary) {
  // The exception's type information comes from libtensorshm.so: a catch here must match it.
  StatusOr<int> error = Status(StatusCode::kPermissionDenied, "uid 65534");
  try {
    (void)error.value();
    FAIL() << "value() of an error returned";
  } catch (const BadStatusOrAccess& e) {
    EXPECT_EQ(e.status().code(), StatusCode::kPermissionDenied);
    EXPECT_EQ(std::string(e.what()), "StatusOr::value() of an error: PERMISSION_DENIED: uid 65534");
  }
  // The same from a real call: Connect to a socket that is not there.
  ClientOptions options;
  options.socket = "/nonexistent/tensorshm.sock";
  options.connect_timeout = std::chrono::milliseconds(200);
  EXPECT_THROW((void)Client::Connect(options).value(), BadStatusOrAccess);
}

TEST(PublicStatusTest, ConversionsKeepCodesMessagesAndWaits) {
  const absl::Status internal = absl::ResourceExhaustedError("pool full");
  const Status outside = ToPublic(internal);
  EXPECT_EQ(outside.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(outside.message(), "pool full");
  EXPECT_EQ(ToAbsl(outside), internal);

  EXPECT_EQ(ToAbsl(kForever), absl::InfiniteDuration());
  EXPECT_EQ(ToAbsl(Duration::zero()), absl::ZeroDuration());
  EXPECT_EQ(ToAbsl(std::chrono::milliseconds(-5)), absl::ZeroDuration());
  EXPECT_EQ(ToAbsl(std::chrono::milliseconds(1500)), absl::Milliseconds(1500));
  EXPECT_EQ(ToChrono(absl::InfiniteDuration()), kForever);
  EXPECT_EQ(ToChrono(absl::Seconds(-1)), Duration::zero());
  EXPECT_EQ(ToChrono(absl::Microseconds(250)), std::chrono::microseconds(250));
}

}  // namespace
}  // namespace tensorshm
