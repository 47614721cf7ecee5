// Warm memory (issue 20): a producer's buffers lie in its long-lived writable mapping of the
// segment, populated when handed out, so filling one never faults; a consumer's read-only
// mapping is populated when made; a published tensor hands out no writable pointer; what a new
// buffer holds. A real daemon, this process the client (producer and consumer both).
#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

int64_t MinorFaults() {
  rusage usage;
  // Every thread of the process, the clients' own included: a mapping a client made is populated
  // on its sender thread, and Flush returns once what was queued before it is done.
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// ASan's and TSan's shadow memory is mapped lazily: the first check of a new buffer's shadow
// faults in pages that are not the buffer's. Fault counts are checked in the plain build.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kShadowMemory = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kShadowMemory = true;
#else
constexpr bool kShadowMemory = false;
#endif
#else
constexpr bool kShadowMemory = false;
#endif

#define SKIP_FAULT_COUNTS_UNDER_SANITIZERS()                                                    \
  if (kShadowMemory) {                                                                          \
    GTEST_SKIP() << "built with a sanitizer, whose shadow memory faults in on first use: page " \
                    "faults are counted in the plain build";                                    \
  }

class WarmMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(
        "warm", {"--host-pool", "192Mi", "--segment-size", "32Mi", "--max-tensors", "1024"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "warm_memory_test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *client;
  }

  // Creates a uint8 tensor of `size` bytes, fills it with `value` and returns the minor faults
  // the fill took; publishes it as `name`.
  int64_t FillAndPublish(int64_t size, unsigned char value, const std::string& name) {
    tensorshm::StatusOr<WritableTensor> tensor = client_->Create({{kDLUInt, 8, 1}, {size}});
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    if (!tensor.ok()) return -1;
    EXPECT_TRUE(client_->Flush().ok());  // stock the create's answer brought is populated
    const int64_t before = MinorFaults();
    std::memset(tensor->data(), value, static_cast<size_t>(size));
    const int64_t faults = MinorFaults() - before;
    tensorshm::Status published = client_->Publish(*tensor, name, /*replace=*/true);
    EXPECT_TRUE(published.ok()) << published;
    return faults;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
};

TEST_F(WarmMemoryTest, FillingABufferNeverFaults) {
  SKIP_FAULT_COUNTS_UNDER_SANITIZERS();
  // Small (stocked after a few creates), one segment's worth, and larger than a segment (a
  // segment of its own, reused once freed).
  for (int64_t size : {int64_t{4096}, int64_t{1} << 20, int64_t{8} << 20, int64_t{48} << 20}) {
    for (int round = 0; round < 10; ++round) {
      const std::string name = absl::StrCat("warm/", size);
      EXPECT_EQ(FillAndPublish(size, static_cast<unsigned char>(round), name), 0)
          << size << " bytes, round " << round;
      ASSERT_TRUE(client_->Delete(name).ok());
      ASSERT_TRUE(client_->Flush().ok());
    }
  }
}

TEST_F(WarmMemoryTest, ReadingAnAcquiredTensorNeverFaults) {
  SKIP_FAULT_COUNTS_UNDER_SANITIZERS();
  const int64_t size = int64_t{8} << 20;
  ASSERT_GE(FillAndPublish(size, 0x21, "warm/read"), 0);
  // Another client: a consumer that maps the segment for the first time.
  tensorshm::StatusOr<std::shared_ptr<Client>> consumer =
      Client::Connect(ClientOptions{daemon_->socket(), "warm_consumer"});
  ASSERT_TRUE(consumer.ok()) << consumer.status();
  tensorshm::StatusOr<DLManagedTensorVersioned*> acquired = (*consumer)->Acquire("warm/read");
  ASSERT_TRUE(acquired.ok()) << acquired.status();
  const auto* bytes = static_cast<const volatile unsigned char*>((*acquired)->dl_tensor.data);
  // The rest of the segment is populated in the background: done once Flush returns.
  ASSERT_TRUE((*consumer)->Flush().ok());
  ASSERT_TRUE(client_->Flush().ok());
  const int64_t before = MinorFaults();
  uint64_t sum = 0;
  for (int64_t i = 0; i < size; i += 4096) sum += bytes[i];
  EXPECT_EQ(MinorFaults() - before, 0);
  EXPECT_EQ(sum, static_cast<uint64_t>(size / 4096) * 0x21);
  (*acquired)->deleter(*acquired);
}

TEST_F(WarmMemoryTest, PublishedTensorHandsOutNoWritablePointer) {
  tensorshm::StatusOr<WritableTensor> tensor = client_->Create({{kDLFloat, 32, 1}, {1024}});
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  ASSERT_NE(tensor->data(), nullptr);
  ASSERT_TRUE(client_->Publish(*tensor, "warm/sealed").ok());
  EXPECT_EQ(tensor->data(), nullptr);
  EXPECT_EQ(tensor->dl_tensor().data, nullptr);
  EXPECT_TRUE(tensor->published());
}

TEST_F(WarmMemoryTest, NewBufferHoldsZerosOrThisUidsLeftovers) {
  const int64_t size = int64_t{1} << 20;
  for (int round = 0; round < 4; ++round) {
    ASSERT_GE(FillAndPublish(size, 0x5a, "warm/leftover"), 0);
    ASSERT_TRUE(client_->Delete("warm/leftover").ok());
    ASSERT_TRUE(client_->Flush().ok());
    tensorshm::StatusOr<WritableTensor> fresh = client_->Create({{kDLUInt, 8, 1}, {size}});
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    const auto* bytes = static_cast<const unsigned char*>(fresh->data());
    EXPECT_TRUE(
        std::all_of(bytes, bytes + size, [](unsigned char b) { return b == 0 || b == 0x5a; }))
        << "round " << round;
  }
}

}  // namespace
}  // namespace tensorshm::testing
