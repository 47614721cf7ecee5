// Malformed requests sent straight through the generated gRPC stub, bypassing the client's own
// validation: each must get its canonical code and a message naming the field and value, and the
// daemon must keep serving.
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>

#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"
#include "tests/test_daemon.h"

namespace tensorshm::testing {
namespace {

using grpc::StatusCode;

enum class SessionKind { kValid, kMissing, kBogus };

class Wire {
 public:
  explicit Wire(const std::string& socket)
      : channel_(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials())),
        stub_(v1::TensorShm::NewStub(channel_)) {}

  // Opens a session stream and keeps it open; returns its token.
  std::string OpenSession() {
    stream_ = stub_->Session(&stream_context_);
    v1::SessionRequest open;
    open.mutable_open()->set_pid(1);
    open.mutable_open()->set_client_name("malformed_request_test");
    v1::SessionResponse opened;
    if (!stream_->Write(open) || !stream_->Read(&opened)) return "";
    token_ = opened.opened().session_id();
    return token_;
  }

  std::unique_ptr<grpc::ClientContext> Context(SessionKind kind = SessionKind::kValid) {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (kind == SessionKind::kValid) context->AddMetadata("tensorshm-session", token_);
    if (kind == SessionKind::kBogus) context->AddMetadata("tensorshm-session", "0123456789abcdef");
    return context;
  }

  // Sends a release batch on the session stream and turns the first rejection into a Status.
  grpc::Status Release(const v1::ReleaseBatch& batch) {
    v1::SessionRequest request;
    *request.mutable_release() = batch;
    v1::SessionResponse response;
    if (!stream_->Write(request) || !stream_->Read(&response)) {
      return grpc::Status(StatusCode::UNKNOWN, "stream broke");
    }
    if (response.ack().rejected_size() == 0) return grpc::Status::OK;
    const v1::Rejection& r = response.ack().rejected(0);
    return grpc::Status(static_cast<StatusCode>(r.code()), r.message());
  }

  grpc::Status Create(const v1::CreateRequest& request, SessionKind kind = SessionKind::kValid,
                      v1::CreateResponse* out = nullptr) {
    v1::CreateResponse response;
    return stub_->Create(Context(kind).get(), request, out != nullptr ? out : &response);
  }
  grpc::Status Publish(uint64_t tensor_id, const std::string& name, bool replace = false,
                       const std::string& ready_event = "") {
    v1::PublishRequest request;
    request.set_tensor_id(tensor_id);
    request.set_name(name);
    request.set_replace(replace);
    request.set_ready_event(ready_event);
    v1::PublishResponse response;
    return stub_->Publish(Context().get(), request, &response);
  }
  grpc::Status Acquire(const std::string& name, int64_t wait_ms = 0,
                       SessionKind kind = SessionKind::kValid) {
    v1::AcquireRequest request;
    request.set_name(name);
    request.set_wait_ms(wait_ms);
    v1::AcquireResponse response;
    return stub_->Acquire(Context(kind).get(), request, &response);
  }
  grpc::Status Delete(const std::string& name) {
    v1::DeleteRequest request;
    request.set_name(name);
    v1::DeleteResponse response;
    return stub_->Delete(Context().get(), request, &response);
  }
  grpc::Status List(const std::string& prefix) {
    v1::ListRequest request;
    request.set_prefix(prefix);
    v1::ListResponse response;
    return stub_->List(Context().get(), request, &response);
  }
  v1::TensorShm::Stub& stub() { return *stub_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TensorShm::Stub> stub_;
  grpc::ClientContext stream_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  std::string token_;
};

v1::CreateRequest CreateRequest(uint32_t code, uint32_t bits, uint32_t lanes,
                                std::vector<int64_t> shape, std::vector<int64_t> strides = {},
                                int32_t device_type = kDLCPU, int32_t device_id = 0) {
  v1::CreateRequest request;
  request.mutable_dtype()->set_code(code);
  request.mutable_dtype()->set_bits(bits);
  request.mutable_dtype()->set_lanes(lanes);
  request.mutable_shape()->Assign(shape.begin(), shape.end());
  request.mutable_strides()->Assign(strides.begin(), strides.end());
  request.mutable_device()->set_type(device_type);
  request.mutable_device()->set_id(device_id);
  return request;
}

struct Case {
  const char* label;
  std::function<grpc::Status(Wire&)> call;
  StatusCode code;
  std::string message_contains;  // names the field and value
};

class MalformedRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TestDaemon> daemon =
        TestDaemon::Start("malformed", {"--host-pool", "64Mi", "--segment-size", "16Mi"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::make_unique<TestDaemon>(*std::move(daemon));
    wire_ = std::make_unique<Wire>(daemon_->socket());
    ASSERT_FALSE(wire_->OpenSession().empty());
    // Fixtures the cases refer to: a published tensor, an unpublished one, and a tensor created
    // by another session.
    v1::CreateResponse created;
    ASSERT_TRUE(
        wire_->Create(CreateRequest(kDLFloat, 32, 1, {4}), SessionKind::kValid, &created).ok());
    published_id_ = created.tensor_id();
    ASSERT_TRUE(wire_->Publish(published_id_, "fixture/published").ok());
    ASSERT_TRUE(
        wire_->Create(CreateRequest(kDLFloat, 32, 1, {4}), SessionKind::kValid, &created).ok());
    unpublished_id_ = created.tensor_id();
    other_ = std::make_unique<Wire>(daemon_->socket());
    ASSERT_FALSE(other_->OpenSession().empty());
    ASSERT_TRUE(
        other_->Create(CreateRequest(kDLInt, 8, 1, {4}), SessionKind::kValid, &created).ok());
    foreign_id_ = created.tensor_id();
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Wire> wire_;
  std::unique_ptr<Wire> other_;
  uint64_t published_id_ = 0;
  uint64_t unpublished_id_ = 0;
  uint64_t foreign_id_ = 0;
  uint64_t other_lease_ = 0;
};

TEST_F(MalformedRequestTest, EachGetsItsCodeAndTheDaemonKeepsServing) {
  constexpr int64_t kHuge = int64_t{1} << 40;
  const std::vector<Case> cases = {
      {"dtype code unknown", [](Wire& w) { return w.Create(CreateRequest(99, 32, 1, {4})); },
       StatusCode::INVALID_ARGUMENT, "code: 99"},
      {"float with 7 bits", [](Wire& w) { return w.Create(CreateRequest(kDLFloat, 7, 1, {4})); },
       StatusCode::INVALID_ARGUMENT, "bits: 7"},
      {"bfloat with 32 bits",
       [](Wire& w) { return w.Create(CreateRequest(kDLBfloat, 32, 1, {4})); },
       StatusCode::INVALID_ARGUMENT, "bfloat takes bits 16"},
      {"lanes zero", [](Wire& w) { return w.Create(CreateRequest(kDLInt, 32, 0, {4})); },
       StatusCode::INVALID_ARGUMENT, "lanes: 0"},
      {"lanes above 65535", [](Wire& w) { return w.Create(CreateRequest(kDLInt, 32, 70000, {4})); },
       StatusCode::INVALID_ARGUMENT, "lanes: 70000"},
      {"opaque handle",
       [](Wire& w) { return w.Create(CreateRequest(kDLOpaqueHandle, 64, 1, {4})); },
       StatusCode::INVALID_ARGUMENT, "opaque handle"},
      {"vector of float4",
       [](Wire& w) { return w.Create(CreateRequest(kDLFloat4_e2m1fn, 4, 2, {4})); },
       StatusCode::INVALID_ARGUMENT, "lanes: 2"},
      {"33 dimensions",
       [](Wire& w) {
         return w.Create(CreateRequest(kDLFloat, 32, 1, std::vector<int64_t>(33, 1)));
       },
       StatusCode::INVALID_ARGUMENT, "33 dimensions"},
      {"negative dimension",
       [](Wire& w) {
         return w.Create(CreateRequest(kDLFloat, 32, 1, {2, -3}));
       },
       StatusCode::INVALID_ARGUMENT, "shape[1] = -3"},
      {"element count overflows",
       [](Wire& w) {
         return w.Create(CreateRequest(kDLFloat, 32, 1, {kHuge, kHuge}));
       },
       StatusCode::INVALID_ARGUMENT, "element count overflows"},
      {"byte size overflows",
       [](Wire& w) { return w.Create(CreateRequest(kDLFloat, 64, 1, {int64_t{1} << 61})); },
       StatusCode::INVALID_ARGUMENT, "overflows"},
      {"stride count differs from ndim",
       [](Wire& w) {
         return w.Create(CreateRequest(kDLFloat, 32, 1, {2, 2}, {1}));
       },
       StatusCode::INVALID_ARGUMENT, "strides = [1]: 1 values for 2 dimensions"},
      {"stride extent overflows",
       [](Wire& w) {
         return w.Create(CreateRequest(kDLFloat, 32, 1, {4, 2}, {int64_t{1} << 62, 1}));
       },
       StatusCode::INVALID_ARGUMENT, "stride extent overflows"},
      {"sub-byte dtype with strides",
       [](Wire& w) {
         return w.Create(CreateRequest(kDLFloat4_e2m1fn, 4, 1, {4, 4}, {1, 4}));
       },
       StatusCode::INVALID_ARGUMENT, "C-contiguous"},
      {"subbyte_padded for a whole-byte dtype",
       [](Wire& w) {
         v1::CreateRequest request = CreateRequest(kDLFloat, 32, 1, {4});
         request.set_subbyte_padded(true);
         return w.Create(request);
       },
       StatusCode::INVALID_ARGUMENT, "subbyte_padded: dtype float32"},
      {"unknown device type",
       [](Wire& w) { return w.Create(CreateRequest(kDLFloat, 32, 1, {4}, {}, 99)); },
       StatusCode::INVALID_ARGUMENT, "type: 99"},
      {"cpu device id 3",
       [](Wire& w) { return w.Create(CreateRequest(kDLFloat, 32, 1, {4}, {}, kDLCPU, 3)); },
       StatusCode::INVALID_ARGUMENT, "cpu:3"},
      {"cuda device without a pool",
       [](Wire& w) { return w.Create(CreateRequest(kDLFloat, 32, 1, {4}, {}, kDLCUDA, 0)); },
       StatusCode::FAILED_PRECONDITION, "cuda:0"},
      {"larger than the pool",
       [](Wire& w) { return w.Create(CreateRequest(kDLUInt, 8, 1, {int64_t{1} << 30})); },
       StatusCode::RESOURCE_EXHAUSTED, "1073741824 bytes"},
      {"no session metadata",
       [](Wire& w) { return w.Create(CreateRequest(kDLFloat, 32, 1, {4}), SessionKind::kMissing); },
       StatusCode::INVALID_ARGUMENT, "tensorshm-session: missing"},
      {"unknown session",
       [](Wire& w) { return w.Create(CreateRequest(kDLFloat, 32, 1, {4}), SessionKind::kBogus); },
       StatusCode::FAILED_PRECONDITION, "0123456789abcdef"},
      {"acquire with unknown session",
       [](Wire& w) { return w.Acquire("fixture/published", 0, SessionKind::kBogus); },
       StatusCode::FAILED_PRECONDITION, "no open session"},
      {"empty name", [this](Wire& w) { return w.Publish(unpublished_id_, ""); },
       StatusCode::INVALID_ARGUMENT, "name = \"\""},
      {"name with leading slash", [this](Wire& w) { return w.Publish(unpublished_id_, "/abs"); },
       StatusCode::INVALID_ARGUMENT, "name = \"/abs\""},
      {"name with dot-dot element",
       [this](Wire& w) { return w.Publish(unpublished_id_, "a/../b"); },
       StatusCode::INVALID_ARGUMENT, "\"..\""},
      {"name with empty element", [](Wire& w) { return w.Acquire("a//b"); },
       StatusCode::INVALID_ARGUMENT, "name = \"a//b\""},
      {"name with a space", [this](Wire& w) { return w.Publish(unpublished_id_, "a b"); },
       StatusCode::INVALID_ARGUMENT, "byte 1"},
      {"name with a NUL byte", [](Wire& w) { return w.Delete(std::string("a\0b", 3)); },
       StatusCode::INVALID_ARGUMENT, "byte 1 (\"\\x00\")"},
      {"name of 256 bytes",
       [this](Wire& w) { return w.Publish(unpublished_id_, std::string(256, 'n')); },
       StatusCode::INVALID_ARGUMENT, "256 bytes"},
      {"list prefix with a bad byte", [](Wire& w) { return w.List("batch*"); },
       StatusCode::INVALID_ARGUMENT, "prefix = \"batch*\""},
      {"publish unknown tensor", [](Wire& w) { return w.Publish(987654321, "x"); },
       StatusCode::NOT_FOUND, "tensor_id = 987654321"},
      {"publish twice", [this](Wire& w) { return w.Publish(published_id_, "again"); },
       StatusCode::FAILED_PRECONDITION, "already published"},
      {"publish onto a bound name",
       [this](Wire& w) { return w.Publish(unpublished_id_, "fixture/published"); },
       StatusCode::ALREADY_EXISTS, "name = \"fixture/published\""},
      {"publish another session's tensor",
       [this](Wire& w) { return w.Publish(foreign_id_, "stolen"); }, StatusCode::PERMISSION_DENIED,
       std::to_string(foreign_id_)},
      {"ready event of the wrong size",
       [this](Wire& w) { return w.Publish(unpublished_id_, "evt", false, std::string(13, 'e')); },
       StatusCode::INVALID_ARGUMENT, "ready_event: 13 bytes"},
      {"ready event for a host tensor",
       [this](Wire& w) { return w.Publish(unpublished_id_, "evt", false, std::string(64, 'e')); },
       StatusCode::INVALID_ARGUMENT, "only CUDA tensors take one"},
      {"device uuid for a host device",
       [](Wire& w) {
         v1::CreateRequest request = CreateRequest(kDLFloat, 32, 1, {4});
         request.set_device_uuid(std::string(16, 'u'));
         return w.Create(request);
       },
       StatusCode::INVALID_ARGUMENT, "only CUDA devices take one"},
      {"cuda tensor from a daemon without CUDA pools",
       [](Wire& w) {
         v1::CreateRequest request = CreateRequest(kDLFloat, 32, 1, {4});
         request.mutable_device()->set_type(kDLCUDA);
         request.set_device_uuid(std::string(16, 'u'));
         return w.Create(request);
       },
       StatusCode::FAILED_PRECONDITION, "no CUDA pools"},
      {"acquire unpublished name", [](Wire& w) { return w.Acquire("nothing/here"); },
       StatusCode::NOT_FOUND, "name = \"nothing/here\""},
      {"acquire wait runs out", [](Wire& w) { return w.Acquire("nothing/here", 100); },
       StatusCode::DEADLINE_EXCEEDED, "wait_ms = 100"},
      {"delete unbound name", [](Wire& w) { return w.Delete("nothing/here"); },
       StatusCode::NOT_FOUND, "name = \"nothing/here\""},
      {"release a lease not held",
       [](Wire& w) {
         v1::ReleaseBatch batch;
         batch.add_lease_ids(424242);
         return w.Release(batch);
       },
       StatusCode::FAILED_PRECONDITION, "lease_ids[0] = 424242"},
      {"release another session's lease",
       [this](Wire& w) {
         v1::AcquireRequest request;
         request.set_name("fixture/published");
         v1::AcquireResponse acquired;
         grpc::Status status = other_->stub().Acquire(other_->Context().get(), request, &acquired);
         if (!status.ok()) return status;
         other_lease_ = acquired.lease_id();
         v1::ReleaseBatch batch;
         batch.add_lease_ids(other_lease_);
         return w.Release(batch);
       },
       StatusCode::FAILED_PRECONDITION, "not held by this session"},
      {"abandon another session's tensor",
       [this](Wire& w) {
         v1::ReleaseBatch batch;
         batch.add_abandoned_tensor_ids(foreign_id_);
         return w.Release(batch);
       },
       StatusCode::FAILED_PRECONDITION, "abandoned_tensor_ids[0]"},
      {"session stream that does not open",
       [](Wire& w) {
         grpc::ClientContext context;
         auto stream = w.stub().Session(&context);
         v1::SessionRequest request;
         request.mutable_release()->add_lease_ids(1);
         stream->Write(request);
         stream->WritesDone();
         return stream->Finish();
       },
       StatusCode::INVALID_ARGUMENT, "first message must be `open`"},
  };
  ASSERT_GE(cases.size(), 20u);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    grpc::Status status = c.call(*wire_);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), c.message_contains))
        << "message \"" << status.error_message() << "\" does not name \"" << c.message_contains
        << "\"";
  }

  // Nothing was lost and the daemon serves on: the fixture tensor reads back, a new one publishes.
  absl::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon_->socket(), "after"});
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire("fixture/published");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->dl_tensor.shape[0], 4);
  (*t)->deleter(*t);
  absl::StatusOr<WritableTensor> w = (*client)->Create({{kDLFloat, 32, 1}, {8}});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE((*client)->Publish(*w, "after/ok").ok());
  EXPECT_TRUE(wire_->Publish(unpublished_id_, "fixture/second").ok());
  absl::StatusOr<ServerStats> stats = (*client)->Stat();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions, 3);
  // The lease another session tried to release is still held by its owner.
  EXPECT_EQ(stats->leases, 1);
  EXPECT_NE(other_lease_, 0u);
}

}  // namespace
}  // namespace tensorshm::testing
