// The C API never lets a C++ exception cross `extern "C"`: a huge ndim is refused before anything
// is copied, and an allocation that fails inside an entry point (made to fail here by this
// program's own operator new) is an error return with a message, after which the client works on.
#include <cstdlib>
#include <cstring>
#include <future>
#include <limits>
#include <new>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tensorshm/tensorshm.h"
#include "tests/support/test_daemon.h"

// Sanitizers bring their own operator new and delete (a replacement here would mix allocators):
// there the allocation-failure test is skipped.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TSM_SANITIZER_ALLOCATOR 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TSM_SANITIZER_ALLOCATOR 1
#endif
#endif

namespace {

// Allocations on this thread left before one fails with std::bad_alloc; -1: none fails.
thread_local int allocations_before_failure = -1;

#ifndef TSM_SANITIZER_ALLOCATOR
void* Allocate(size_t size) {
  if (allocations_before_failure == 0) {
    allocations_before_failure = -1;
    throw std::bad_alloc();
  }
  if (allocations_before_failure > 0) --allocations_before_failure;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
#endif

}  // namespace

#ifndef TSM_SANITIZER_ALLOCATOR
// The program's replacements of the global allocation functions, which libtensorshm's code uses
// too (they are resolved at run time).
void* operator new(size_t size) { return Allocate(size); }
void* operator new[](size_t size) { return Allocate(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
#endif

namespace tensorshm::testing {
namespace {

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TestDaemon> daemon = TestDaemon::Start("c_api", {"--host-pool", "16Mi"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    ASSERT_EQ(tsm_connect(daemon_->socket().c_str(), "c_api_test", &client_), TSM_OK)
        << tsm_last_error();
  }
  void TearDown() override {
    tsm_client_free(client_);
    daemon_.reset();
  }

  // Creates and publishes a float32 tensor of `n` elements as `name`.
  int CreateAndPublish(const char* name, int64_t n) {
    tsm_writable* w = nullptr;
    int code = tsm_create(client_, kFloat32, 1, &n, nullptr, kCpu, &w);
    if (code != TSM_OK) return code;
    code = tsm_publish(client_, w, name, 0);
    tsm_writable_free(w);
    return code;
  }

  static constexpr DLDataType kFloat32 = {kDLFloat, 32, 1};
  static constexpr DLDevice kCpu = {kDLCPU, 0};
  std::unique_ptr<TestDaemon> daemon_;
  tsm_client* client_ = nullptr;
};

TEST_F(CApiTest, NdimOutOfRangeIsRefusedBeforeShapeIsRead) {
  // One value where the call is told there are billions: read, it would run far past the array.
  const int64_t shape[1] = {4};
  for (int32_t ndim : {std::numeric_limits<int32_t>::max(), 1 << 28, 33, -1}) {
    SCOPED_TRACE(ndim);
    tsm_writable* w = reinterpret_cast<tsm_writable*>(0x1);
    EXPECT_EQ(tsm_create(client_, kFloat32, ndim, shape, shape, kCpu, &w), TSM_INVALID_ARGUMENT);
    EXPECT_EQ(w, nullptr);
    const std::string message = tsm_last_error();
    std::cout << "tsm_create(ndim = " << ndim << "): " << message << "\n";
    EXPECT_TRUE(absl::StrContains(message, "ndim = " + std::to_string(ndim))) << message;
    EXPECT_TRUE(absl::StrContains(message, "0..32")) << message;
  }
  EXPECT_EQ(CreateAndPublish("c/after_ndim", 8), TSM_OK) << tsm_last_error();
}

// A timeout longer than the C++ API's nanoseconds hold waits as TSM_WAIT_FOREVER does, where a
// conversion that overflowed would make it negative: NOT_FOUND at once.
TEST_F(CApiTest, ATimeoutPastWhatNanosecondsHoldWaitsForThePublish) {
  std::future<int> acquired = std::async(std::launch::async, [&] {
    DLManagedTensorVersioned* t = nullptr;
    const int code = tsm_acquire(client_, "c/later", std::numeric_limits<int64_t>::max(), &t);
    if (code == TSM_OK) t->deleter(t);
    return code;
  });
  // Nothing answers it while the name is unbound.
  EXPECT_EQ(acquired.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  EXPECT_EQ(CreateAndPublish("c/later", 4), TSM_OK) << tsm_last_error();
  ASSERT_EQ(acquired.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_EQ(acquired.get(), TSM_OK);
}

TEST_F(CApiTest, FailedAllocationIsAnErrorReturnNotAnException) {
#ifdef TSM_SANITIZER_ALLOCATOR
  GTEST_SKIP() << "a sanitizer build: its operator new cannot be made to fail here";
#endif
  const int64_t shape[2] = {2, 3};
  tsm_writable* w = reinterpret_cast<tsm_writable*>(0x1);
  allocations_before_failure = 0;  // the copy of the shape
  const int code = tsm_create(client_, kFloat32, 2, shape, nullptr, kCpu, &w);
  allocations_before_failure = -1;
  EXPECT_EQ(code, TSM_RESOURCE_EXHAUSTED);
  EXPECT_EQ(w, nullptr);
  std::cout << "tsm_create with no memory: " << tsm_last_error() << "\n";
  EXPECT_TRUE(absl::StrContains(tsm_last_error(), "tsm_create: out of memory")) << tsm_last_error();

  // The socket path is longer than a std::string holds in place: copying it allocates.
  ASSERT_GT(daemon_->socket().size(), 15u);
  tsm_client* other = reinterpret_cast<tsm_client*>(0x1);
  allocations_before_failure = 0;
  const int connected = tsm_connect(daemon_->socket().c_str(), "c_api_test", &other);
  allocations_before_failure = -1;
  EXPECT_EQ(connected, TSM_RESOURCE_EXHAUSTED);
  EXPECT_EQ(other, nullptr);
  EXPECT_TRUE(absl::StrContains(tsm_last_error(), "tsm_connect: out of memory"))
      << tsm_last_error();

  // Nothing was left half-done: the client creates, publishes, acquires and stats on.
  EXPECT_EQ(CreateAndPublish("c/after_oom", 6), TSM_OK) << tsm_last_error();
  DLManagedTensorVersioned* t = nullptr;
  ASSERT_EQ(tsm_acquire(client_, "c/after_oom", 0, &t), TSM_OK) << tsm_last_error();
  EXPECT_EQ(t->dl_tensor.shape[0], 6);
  t->deleter(t);
  ASSERT_EQ(tsm_flush(client_), TSM_OK) << tsm_last_error();
  tsm_stats stats{};
  ASSERT_EQ(tsm_stat(client_, &stats), TSM_OK) << tsm_last_error();
  EXPECT_EQ(stats.leases, 0);
  EXPECT_EQ(stats.tensors, 1);
}

}  // namespace
}  // namespace tensorshm::testing
