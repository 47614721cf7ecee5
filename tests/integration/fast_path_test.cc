// The fast path as clients see it: leases beyond a lease page's slots, buffers made from stock,
// and lease counts, against a real tensorshmd.
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm {
namespace {

using testing::TestDaemon;

class FastPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    absl::StatusOr<TestDaemon> daemon = TestDaemon::Start(absl::StrCat("fp-", name.substr(0, 20)));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "fast-path-test"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  ServerStats Stats() {
    tensorshm::StatusOr<ServerStats> stats = client_->Stat();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : ServerStats{};
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<Client> client_;
};

// A lease page has 504 lease slots; the leases after that are the daemon's, and all count the same.
TEST_F(FastPathTest, MoreLeasesThanALeasePageHoldsAreTakenByRpc) {
  tensorshm::StatusOr<WritableTensor> w = client_->Create({{kDLInt, 32, 1}, {256}});
  ASSERT_TRUE(w.ok()) << w.status();
  for (int i = 0; i < 256; ++i) static_cast<int32_t*>(w->data())[i] = i * 3;
  ASSERT_TRUE(client_->Publish(*w, "many").ok());
  std::vector<DLManagedTensorVersioned*> held;
  for (int i = 0; i < 600; ++i) {
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = client_->Acquire("many");
    ASSERT_TRUE(t.ok()) << i << ": " << t.status();
    ASSERT_EQ(static_cast<const int32_t*>((*t)->dl_tensor.data)[255], 255 * 3);
    held.push_back(*t);
  }
  EXPECT_EQ(Stats().leases, 600);
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = client_->List("many");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].leases, 600);
  // Deleted while leased: the bytes stay until the last of both kinds of lease is gone.
  ASSERT_TRUE(client_->Delete("many").ok());
  for (size_t i = 0; i + 1 < held.size(); ++i) held[i]->deleter(held[i]);
  ASSERT_TRUE(client_->Flush().ok());
  EXPECT_EQ(Stats().tensors, 1);
  EXPECT_EQ(static_cast<const int32_t*>(held.back()->dl_tensor.data)[17], 17 * 3);
  held.back()->deleter(held.back());
  ASSERT_TRUE(client_->Flush().ok());
  ServerStats after = Stats();
  EXPECT_EQ(after.leases, 0);
  EXPECT_EQ(after.tensors, 0);
  EXPECT_EQ(after.pools[0].used_bytes, 0);
}

// A producer in a loop gets buffers ahead of need; tensors made of them reach consumers with the
// descriptor the producer gave them, whatever the stocked buffer was.
TEST_F(FastPathTest, TensorsMadeFromStockCarryTheirOwnDescriptor) {
  tensorshm::StatusOr<std::shared_ptr<Client>> consumer =
      Client::Connect(ClientOptions{daemon_->socket(), "consumer"});
  ASSERT_TRUE(consumer.ok());
  const std::vector<TensorSpec> specs = {
      {{kDLFloat, 32, 1}, {1024}},
      {{kDLInt, 16, 1}, {32, 64}},
      {{kDLUInt, 8, 1}, {4000}},
      {{kDLFloat, 64, 1}, {16, 8}, {1, 16}},  // column-major
  };
  for (int i = 0; i < 40; ++i) {
    const TensorSpec& spec = specs[i % specs.size()];
    tensorshm::StatusOr<WritableTensor> w = client_->Create(spec);
    ASSERT_TRUE(w.ok()) << i << ": " << w.status();
    auto* bytes = static_cast<unsigned char*>(w->data());
    for (int64_t b = 0; b < w->nbytes(); ++b) bytes[b] = static_cast<unsigned char>(b * 7 + i);
    const std::string name = absl::StrCat("stock/", i);
    ASSERT_TRUE(client_->Publish(*w, name).ok()) << i;
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*consumer)->Acquire(name);
    ASSERT_TRUE(t.ok()) << i << ": " << t.status();
    const DLTensor& got = (*t)->dl_tensor;
    EXPECT_EQ(got.dtype.code, spec.dtype.code) << i;
    EXPECT_EQ(got.dtype.bits, spec.dtype.bits) << i;
    ASSERT_EQ(got.ndim, static_cast<int32_t>(spec.shape.size())) << i;
    for (int d = 0; d < got.ndim; ++d) EXPECT_EQ(got.shape[d], spec.shape[d]) << i;
    if (!spec.strides.empty()) {
      for (int d = 0; d < got.ndim; ++d) EXPECT_EQ(got.strides[d], spec.strides[d]) << i;
    }
    const auto* read = static_cast<const unsigned char*>(got.data) + got.byte_offset;
    int64_t wrong = 0;
    for (int64_t b = 0; b < w->nbytes(); ++b) {
      wrong += read[b] != static_cast<unsigned char>(b * 7 + i);
    }
    EXPECT_EQ(wrong, 0) << i;
    (*t)->deleter(*t);
    ASSERT_TRUE(client_->Delete(name).ok());
  }
  // The producer holds stock now; it goes with its session.
  EXPECT_GT(Stats().tensors, 0);
  client_.reset();
  tensorshm::StatusOr<ServerStats> stats = (*consumer)->Stat();
  for (int i = 0; i < 200 && stats.ok() && stats->tensors != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    stats = (*consumer)->Stat();
  }
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->tensors, 0);
  EXPECT_EQ(stats->pools[0].used_bytes, 0);
}

}  // namespace
}  // namespace tensorshm
