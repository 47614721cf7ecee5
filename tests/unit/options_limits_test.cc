// Sizes and counts at the edges of their types: option parsing and the /dev/shm capacity check
// never wrap, and say which flag and value were refused.
#include <sys/statvfs.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/ops/options.h"

namespace tensorshm {
namespace {

absl::StatusOr<DaemonOptions> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "tensorshmd");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  return ParseOptions(static_cast<int>(argv.size()), argv.data());
}

// Refused with INVALID_ARGUMENT naming the flag and the value.
void ExpectRefused(const std::string& flag, const std::string& value) {
  SCOPED_TRACE(flag + " " + value);
  absl::StatusOr<DaemonOptions> options = Parse({flag, value});
  ASSERT_FALSE(options.ok()) << flag << " " << value << " was taken";
  EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(options.status().message());
  std::cout << flag << " " << value << ": " << message << "\n";
  EXPECT_TRUE(absl::StrContains(message, flag)) << message;
  EXPECT_TRUE(absl::StrContains(message, value)) << message;
}

TEST(OptionLimitsTest, SizesThatWouldWrapAreRefused) {
  // value * suffix past 2^64.
  ExpectRefused("--host-pool", "99999999999Ti");
  ExpectRefused("--host-pool", "18446744073709551615Ki");
  // Below 2^64, but rounding up to a page (or adding the catalog) would wrap, and an off_t
  // cannot hold them.
  ExpectRefused("--host-pool", "18446744073709551615B");
  ExpectRefused("--host-pool", "18446744073709547521B");
  ExpectRefused("--segment-size", "16777215Ti");
  ExpectRefused("--session-quota", "9223372036854775808B");
  ExpectRefused("--cuda-segment-size", "18446744073709551615B");
  ExpectRefused("--cuda-pool", "cuda:0=18446744073709551615B");
  // Not a number that fits at all.
  ExpectRefused("--host-pool", "99999999999999999999999B");
}

TEST(OptionLimitsTest, TheLargestSizeIsTakenAndRoundsWithoutWrapping) {
  const std::string largest = std::to_string(kMaxSizeBytes) + "B";
  absl::StatusOr<DaemonOptions> options =
      Parse({"--host-pool", largest, "--segment-size", "4194304Ti", "--cuda-pool",
             "cuda:0=" + std::to_string(kMaxSizeBytes - 1) + "B"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->host_pool_bytes, kMaxSizeBytes);
  EXPECT_EQ(options->segment_bytes, kMaxSizeBytes);
  EXPECT_EQ(options->cuda_pools.at(0).bytes, kMaxSizeBytes);  // rounded up to 256 bytes
  // One byte less rounds up to a page, not past it.
  options = Parse({"--host-pool", std::to_string(kMaxSizeBytes - 1) + "B"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->host_pool_bytes, kMaxSizeBytes);
  ExpectRefused("--host-pool", std::to_string(kMaxSizeBytes + 1) + "B");
}

TEST(OptionLimitsTest, CountsOutOfRangeAreRefused) {
  ExpectRefused("--max-tensors", "99999999999999999999");
  ExpectRefused("--max-tensors", "4294967296");  // 2^32: wraps a uint32 to 0
  ExpectRefused("--max-tensors", "16777217");
  ExpectRefused("--max-tensors", "-1");
  ExpectRefused("--recovery-grace", "99999999999999999999");
  ExpectRefused("--allow-uid", "4294967296");
  ExpectRefused("--cuda-pool", "cuda:99999999999=1Gi");
}

struct statvfs Shm(uint64_t frsize, uint64_t blocks, uint64_t free_blocks) {
  struct statvfs shm {};
  shm.f_frsize = frsize;
  shm.f_bsize = frsize;
  shm.f_blocks = blocks;
  shm.f_bavail = free_blocks;
  shm.f_bfree = free_blocks;
  return shm;
}

TEST(ShmCapacityTest, HugeFileSystemsSaturateInsteadOfWrapping) {
  std::string warning;
  // 2^20-byte blocks, 2^50 of them: 2^70 bytes, which wraps to 0 in 64 bits.
  const struct statvfs huge = Shm(uint64_t{1} << 20, uint64_t{1} << 50, uint64_t{1} << 50);
  EXPECT_TRUE(CheckShmCapacity(uint64_t{1} << 40, 4 << 20, huge, &warning).ok());
  EXPECT_TRUE(warning.empty()) << warning;
  // A pool plus catalog past 2^64 does not wrap to something small that fits.
  const struct statvfs small = Shm(4096, 1 << 20, 1 << 20);  // 4 GiB
  absl::Status status = CheckShmCapacity(UINT64_MAX - 10, 1 << 20, small, &warning);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(status.message(), "--host-pool")) << status;
  std::cout << status.message() << "\n";
}

TEST(ShmCapacityTest, TooSmallIsRefusedAndShortOfFreeIsAWarning) {
  std::string warning;
  const struct statvfs shm = Shm(4096, 1024, 256);  // 4 MiB, 1 MiB free
  absl::Status status = CheckShmCapacity(8 << 20, 4096, shm, &warning);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(absl::StrContains(status.message(), "--host-pool = 8388608 bytes")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "holds 4194304 bytes (1048576 free)")) << status;
  EXPECT_TRUE(CheckShmCapacity(2 << 20, 4096, shm, &warning).ok());
  EXPECT_TRUE(absl::StrContains(warning, "1048576 bytes free")) << warning;
}

}  // namespace
}  // namespace tensorshm
