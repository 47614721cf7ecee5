// The Store without any transport: sessions, create (growing the pool on GrowPools' thread),
// publish, acquire (at once and waiting for a publish), delete, list, and the waits' deadlines and
// shutdown, on an in-process Store over a small host pool. No gRPC, no memory channel.
#include "server/core/store.h"

// The Store knows no wire format (docs/design.md): nothing it includes brings in the messages.
#ifdef GOOGLE_PROTOBUF_INCLUDED_tensorshm_2fv1_2ftensorshm_2eproto
#error "server/core/store.h includes tensorshm.pb.h; the Store must work in its own terms"
#endif

#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tensorshm {
namespace {

constexpr absl::Duration kPatience = absl::Seconds(30);  // a generous bound, never a timing

// What a transport would do with an answer given later: keep it.
class Answered {
 public:
  void Set(absl::Status status, bool granted) {
    status_ = std::move(status);
    granted_ = granted;
    done_.Notify();
  }
  // The answer, once given (nullopt if none came within kPatience).
  std::optional<absl::Status> Wait() {
    if (!done_.WaitForNotificationWithTimeout(kPatience)) return std::nullopt;
    return status_;
  }
  bool answered() const { return done_.HasBeenNotified(); }
  bool granted() const { return granted_; }

 private:
  absl::Notification done_;
  absl::Status status_;
  bool granted_ = false;
};

class TestCreate final : public CreateCall {
 public:
  explicit TestCreate(CreateOrder order) : CreateCall(std::move(order)) {}
  void Answer(absl::Status status, bool granted) override { answered.Set(status, granted); }
  Answered answered;
};

class TestAcquire final : public AcquireWait {
 public:
  explicit TestAcquire(AcquireOrder order) : AcquireWait(std::move(order)) {}
  void Answer(absl::Status status, bool granted) override { answered.Set(status, granted); }
  bool Cancelled() const override { return false; }
  Answered answered;
};

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = absl::StrCat("tsmtest-store-", getpid());
    boost::interprocess::shared_memory_object::remove((prefix_ + ".ctl").c_str());
    CatalogOptions options{prefix_, 8 << 20, 2 << 20, 64};
    options.backing = SegmentBacking::kMemfd;
    absl::StatusOr<std::unique_ptr<Catalog>> catalog = Catalog::Create(options);
    ASSERT_TRUE(catalog.ok()) << catalog.status();
    store_ = std::make_unique<Store>(*std::move(catalog));
    grower_ = std::thread([this] { store_->GrowPools(); });
    timer_ = std::thread([this] { store_->ExpireWaiters(); });
  }

  void TearDown() override {
    if (store_ == nullptr) return;
    store_->BeginShutdown();
    grower_.join();
    timer_.join();
    store_.reset();
    boost::interprocess::shared_memory_object::remove((prefix_ + ".ctl").c_str());
  }

  // Opens a session for `peer`; its token.
  std::string Open(const PeerCredentials& peer) {
    SessionOpening open;
    open.client_name = "store_test";
    open.pid = peer.pid;
    absl::StatusOr<OpenedSession> opened = store_->OpenSession(peer, "test", open);
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return "";
    EXPECT_NE(opened->session_number, 0u);
    EXPECT_FALSE(opened->token.empty());
    ids_[opened->token] = opened->session_number;
    return opened->token;
  }

  // Creates a uint8 host tensor of `bytes` for the session `token`; its id. The first create
  // grows the pool, on GrowPools' thread, and is answered there.
  absl::StatusOr<uint64_t> Create(const std::string& token, int64_t bytes) {
    TestCreate call(CreateOrder{.spec = {.dtype = DLDataType{kDLUInt, 8, 1}, .shape = {bytes}}});
    bool answered_later = false;
    absl::Status status = store_->Create(peer_, token, &call, &answered_later);
    if (answered_later) {
      std::optional<absl::Status> answer = call.answered.Wait();
      if (!answer.has_value()) return absl::DeadlineExceededError("GrowPools never answered");
      status = *answer;
    }
    if (!status.ok()) return status;
    EXPECT_EQ(call.created.desc.nbytes, bytes);
    EXPECT_EQ(call.created.place.length, static_cast<uint64_t>(bytes));
    EXPECT_TRUE(call.created.place.shm_name.has_value());  // a host segment's span
    return call.created.tensor_id;
  }

  absl::Status Publish(const std::string& token, uint64_t tensor_id, const std::string& name) {
    return store_->Publish(peer_, token, PublishOrder{.tensor_id = tensor_id, .name = name})
        .status();
  }

  const PeerCredentials peer_{.pid = getpid(), .uid = getuid(), .gid = getgid()};
  std::string prefix_;
  std::unique_ptr<Store> store_;
  std::thread grower_;
  std::thread timer_;
  std::map<std::string, uint64_t> ids_;
};

TEST_F(StoreTest, CreatePublishAcquireAndDeleteWithoutATransport) {
  const std::string token = Open(peer_);
  absl::StatusOr<uint64_t> tensor = Create(token, 4096);
  ASSERT_TRUE(tensor.ok()) << tensor.status();

  // An acquire that may wait is listed until the publish, which answers it with a lease.
  TestAcquire waiter(AcquireOrder{.name = "store.t", .wait_ms = 60000});
  waiter.deadline = absl::Now() + absl::Minutes(1);
  bool answered_later = false;
  ASSERT_TRUE(store_->Acquire(peer_, token, &waiter, &answered_later).ok());
  ASSERT_TRUE(answered_later);
  EXPECT_FALSE(waiter.answered.answered());
  ASSERT_TRUE(Publish(token, *tensor, "store.t").ok());
  std::optional<absl::Status> woken = waiter.answered.Wait();
  ASSERT_TRUE(woken.has_value());
  EXPECT_TRUE(woken->ok()) << *woken;
  const LeaseGrant& waited = waiter.granted;
  EXPECT_NE(waited.lease_id, 0u);
  EXPECT_EQ(waited.tensor_id, *tensor);
  EXPECT_EQ(waited.desc.nbytes, 4096);
  EXPECT_EQ(waited.place.length, 4096u);
  store_->WaiterDone(&waiter, /*cancelled=*/false);

  // An acquire of a published name is answered at once.
  TestAcquire at_once(AcquireOrder{.name = "store.t"});
  answered_later = false;
  ASSERT_TRUE(store_->Acquire(peer_, token, &at_once, &answered_later).ok());
  EXPECT_FALSE(answered_later);
  EXPECT_EQ(at_once.granted.tensor_id, *tensor);
  EXPECT_NE(at_once.granted.lease_id, waited.lease_id);
  store_->WaiterDone(&at_once, false);

  absl::StatusOr<std::vector<TensorListing>> listed = store_->List(peer_, "");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name, "store.t");
  EXPECT_EQ((*listed)[0].leases, 2);
  EXPECT_EQ(store_->StatSnapshot().sessions, 1);

  EXPECT_TRUE(store_->Delete(peer_, token, "store.t").ok());
  listed = store_->List(peer_, "");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty());

  store_->CloseSession(ids_[token], token);
  EXPECT_EQ(store_->StatSnapshot().sessions, 0);
}

TEST_F(StoreTest, RefusalsAreStatusesWithTheirMessages) {
  const std::string token = Open(peer_);
  TestAcquire at_once(AcquireOrder{.name = "store.missing"});
  bool answered_later = false;
  absl::Status refused = store_->Acquire(peer_, token, &at_once, &answered_later);
  EXPECT_FALSE(answered_later);
  EXPECT_EQ(refused, absl::NotFoundError("name = \"store.missing\": not published"));
  store_->WaiterDone(&at_once, false);

  // A call that names no session, or a session nobody opened.
  const PublishOrder publish{.name = "store.x"};
  EXPECT_EQ(store_->Publish(peer_, std::nullopt, publish).status(),
            absl::InvalidArgumentError("metadata tensorshm-session: missing; open a Session "
                                       "stream and send its id"));
  EXPECT_EQ(store_->Publish(peer_, std::string("nope"), publish).status().code(),
            absl::StatusCode::kFailedPrecondition);
  store_->CloseSession(ids_[token], token);
}

TEST_F(StoreTest, AWaitingAcquireEndsAtItsDeadlineOrWithItsSession) {
  const std::string token = Open(peer_);
  TestAcquire expiring(AcquireOrder{.name = "store.late", .wait_ms = 50});
  expiring.deadline = absl::Now() + absl::Milliseconds(50);
  bool answered_later = false;
  ASSERT_TRUE(store_->Acquire(peer_, token, &expiring, &answered_later).ok());
  ASSERT_TRUE(answered_later);
  std::optional<absl::Status> expired = expiring.answered.Wait();
  ASSERT_TRUE(expired.has_value());
  EXPECT_EQ(*expired, absl::DeadlineExceededError(
                          "name = \"store.late\": not published within wait_ms = 50"));
  store_->WaiterDone(&expiring, false);

  TestAcquire orphan(AcquireOrder{.name = "store.late", .wait_ms = -1});
  answered_later = false;
  ASSERT_TRUE(store_->Acquire(peer_, token, &orphan, &answered_later).ok());
  ASSERT_TRUE(answered_later);
  store_->CloseSession(ids_[token], token);
  std::optional<absl::Status> ended = orphan.answered.Wait();
  ASSERT_TRUE(ended.has_value());
  EXPECT_EQ(ended->code(), absl::StatusCode::kFailedPrecondition) << *ended;
  store_->WaiterDone(&orphan, false);
}

}  // namespace
}  // namespace tensorshm
