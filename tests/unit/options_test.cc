#include "server/ops/options.h"

#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tensorshm {
namespace {

TEST(ParseSizeTest, SuffixesArePowersOfTenOrTwo) {
  EXPECT_EQ(*ParseSize("4096B", "--x"), 4096u);
  EXPECT_EQ(*ParseSize("0", "--x"), 0u);  // zero needs no unit
  EXPECT_EQ(*ParseSize("1K", "--x"), 1000u);
  EXPECT_EQ(*ParseSize("1Ki", "--x"), 1024u);
  EXPECT_EQ(*ParseSize("64Mi", "--x"), 64u << 20);
  EXPECT_EQ(*ParseSize("2G", "--x"), 2000000000u);
  EXPECT_EQ(*ParseSize("2GiB", "--x"), 2ull << 30);
  EXPECT_EQ(*ParseSize("1Ti", "--x"), 1ull << 40);
}

TEST(ParseSizeTest, BadSizesNameFlagAndValue) {
  for (const char* bad : {"", "Mi", "12Q", "1.5G", "-1", "99999999999999999999", "20000000Ti"}) {
    absl::StatusOr<uint64_t> size = ParseSize(bad, "--host-pool");
    ASSERT_FALSE(size.ok()) << bad;
    EXPECT_TRUE(absl::StartsWith(size.status().message(), absl::StrCat("--host-pool = \"", bad)))
        << size.status();
  }
}

// A bare number was once taken as bytes ("--host-pool 1024": a 4 KiB pool); every size flag
// now refuses it, naming the flag, the value and the units it takes.
TEST(ParseSizeTest, EverySizeFlagRefusesANumberWithoutUnit) {
  for (const char* flag :
       {"--host-pool", "--segment-size", "--session-quota", "--uid-quota", "--cuda-segment-size"}) {
    const char* argv[] = {"tensorshmd", flag, "1024"};
    absl::StatusOr<DaemonOptions> options = ParseOptions(3, const_cast<char**>(argv));
    ASSERT_FALSE(options.ok()) << flag;
    const std::string message(options.status().message());
    std::cout << message << "\n";
    EXPECT_TRUE(absl::StartsWith(message, absl::StrCat(flag, " = \"1024\": a size needs a unit")))
        << message;
    for (const char* unit : {"1024B", "Ki", "Mi", "Gi"}) {
      EXPECT_TRUE(absl::StrContains(message, unit)) << message;
    }
  }
  const char* argv[] = {"tensorshmd", "--cuda-pool", "cuda:0=1024"};
  absl::StatusOr<DaemonOptions> options = ParseOptions(3, const_cast<char**>(argv));
  ASSERT_FALSE(options.ok());
  EXPECT_TRUE(absl::StrContains(options.status().message(), "--cuda-pool = \"cuda:0=1024\""))
      << options.status();
  EXPECT_TRUE(absl::StrContains(options.status().message(), "needs a unit")) << options.status();
}

// --version answers alone: the other flags are not checked (a bad one does not stop it).
TEST(ParseOptionsTest, VersionIsReportedWithoutCheckingTheRest) {
  const char* argv[] = {"tensorshmd", "--host-pool", "2Gi", "--version"};
  absl::StatusOr<DaemonOptions> options = ParseOptions(4, const_cast<char**>(argv));
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_TRUE(options->version);
  EXPECT_FALSE(options->help);
  const char* plain[] = {"tensorshmd"};
  EXPECT_FALSE(ParseOptions(1, const_cast<char**>(plain))->version);
}

TEST(ParseOptionsTest, DefaultsAndFlags) {
  const char* argv[] = {"tensorshmd",      "--socket", "/tmp/x.sock", "--host-pool=2Gi",
                        "--shm-prefix",    "abc",      "--log-level", "debug",
                        "--session-quota", "1Mi"};
  absl::StatusOr<DaemonOptions> options = ParseOptions(10, const_cast<char**>(argv));
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->socket, "/tmp/x.sock");
  EXPECT_EQ(options->host_pool_bytes, 2ull << 30);
  EXPECT_EQ(options->segment_bytes, 256ull << 20);
  EXPECT_EQ(options->shm_prefix, "abc");
  EXPECT_EQ(options->log_level, LogLevel::kDebug);
  EXPECT_EQ(options->session_quota_bytes, 1u << 20);
  EXPECT_FALSE(options->memfd_segments);
}

TEST(ParseOptionsTest, SegmentsAreNamedShmOrMemfd) {
  const char* memfd[] = {"tensorshmd", "--segments", "memfd"};
  absl::StatusOr<DaemonOptions> options = ParseOptions(3, const_cast<char**>(memfd));
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_TRUE(options->memfd_segments);
  const char* shm[] = {"tensorshmd", "--segments=shm"};
  options = ParseOptions(2, const_cast<char**>(shm));
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_FALSE(options->memfd_segments);
}

TEST(ParseOptionsTest, RandomPrefixByDefaultAndBadFlagsRefused) {
  const char* plain[] = {"tensorshmd"};
  absl::StatusOr<DaemonOptions> a = ParseOptions(1, const_cast<char**>(plain));
  absl::StatusOr<DaemonOptions> b = ParseOptions(1, const_cast<char**>(plain));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(absl::StartsWith(a->shm_prefix, "tsm-"));
  EXPECT_NE(a->shm_prefix, b->shm_prefix);

  for (std::vector<const char*> argv : std::vector<std::vector<const char*>>{
           {"tensorshmd", "--nope"},
           {"tensorshmd", "--shm-prefix", "a/b"},
           {"tensorshmd", "--max-tensors", "0"},
           {"tensorshmd", "--log-level", "loud"},
           {"tensorshmd", "--host-pool"},
           {"tensorshmd", "--host-pool", "0"},
           {"tensorshmd", "--segments", "tmpfs"},
           {"tensorshmd", "--keep-segments", "--segments", "memfd"},
       }) {
    absl::StatusOr<DaemonOptions> options =
        ParseOptions(static_cast<int>(argv.size()), const_cast<char**>(argv.data()));
    EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument) << argv[1];
    EXPECT_TRUE(absl::StrContains(options.status().message(), argv[1])) << options.status();
  }
}

TEST(ParseOptionsTest, CudaPoolsAreRepeatableOnePerDevice) {
  const char* argv[] = {"tensorshmd",          "--cuda-pool",
                        "cuda:0=1Gi",          "--cuda-pool=cuda:3=1000B",
                        "--cuda-segment-size", "256Mi"};
  absl::StatusOr<DaemonOptions> options = ParseOptions(6, const_cast<char**>(argv));
  ASSERT_TRUE(options.ok()) << options.status();
  ASSERT_EQ(options->cuda_pools.size(), 2u);
  EXPECT_EQ(options->cuda_pools[0].ordinal, 0);
  EXPECT_EQ(options->cuda_pools[0].bytes, 1ull << 30);
  EXPECT_EQ(options->cuda_pools[1].ordinal, 3);
  EXPECT_EQ(options->cuda_pools[1].bytes, 1024u);  // rounded up to 256 bytes
  EXPECT_EQ(options->cuda_segment_bytes, 256u << 20);
  for (const char* bad :
       {"gpu:0=1Gi", "cuda:0", "cuda:x=1Gi", "cuda:-1=1Gi", "cuda:0=0", "cuda:0=lots"}) {
    absl::StatusOr<CudaPoolSpec> spec = ParseCudaPool(bad);
    ASSERT_FALSE(spec.ok()) << bad;
    EXPECT_TRUE(absl::StrContains(spec.status().message(), "--cuda-pool")) << spec.status();
  }
  const char* twice[] = {"tensorshmd", "--cuda-pool", "cuda:1=1Mi", "--cuda-pool", "cuda:1=2Mi"};
  absl::StatusOr<DaemonOptions> refused = ParseOptions(5, const_cast<char**>(twice));
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "cuda:1 has a pool already"));
}

}  // namespace
}  // namespace tensorshm
