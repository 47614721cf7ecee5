// Malformed requests sent straight through the generated gRPC stub, bypassing the client's own
// validation: each must get its canonical code and a message naming the field and value, and the
// daemon must keep serving.
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/shm/channel_frame.h"
#include "gtest/gtest.h"
#include "tensorshm/client.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"
#include "tests/support/test_daemon.h"

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
  grpc::Status Publish(const v1::PublishRequest& request, v1::PublishResponse* out = nullptr) {
    v1::PublishResponse response;
    return stub_->Publish(Context().get(), request, out != nullptr ? out : &response);
  }
  // Sends `batch` and returns the whole acknowledgement (or why there was none).
  absl::StatusOr<v1::ReleaseAck> ReleaseAck(const v1::ReleaseBatch& batch) {
    v1::SessionRequest request;
    *request.mutable_release() = batch;
    v1::SessionResponse response;
    if (!stream_->Write(request) || !stream_->Read(&response)) {
      return absl::UnavailableError("the session stream broke");
    }
    return response.ack();
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
  const std::string& token() const { return token_; }

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
  tensorshm::StatusOr<std::shared_ptr<Client>> client =
      Client::Connect(ClientOptions{daemon_->socket(), "after"});
  ASSERT_TRUE(client.ok()) << client.status();
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire("fixture/published");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->dl_tensor.shape[0], 4);
  (*t)->deleter(*t);
  tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLFloat, 32, 1}, {8}});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE((*client)->Publish(*w, "after/ok").ok());
  EXPECT_TRUE(wire_->Publish(unpublished_id_, "fixture/second").ok());
  tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions, 3);
  // The lease another session tried to release is still held by its owner.
  EXPECT_EQ(stats->leases, 1);
  EXPECT_NE(other_lease_, 0u);
}

// ---- What later work added: the memory channel's requests, stock, PublishRequest.desc and
// .acquire, Session open lists, ReleaseBatch fields ----

// A raw memory channel connection: the hello, then frames, byte for byte.
class ChannelWire {
 public:
  explicit ChannelWire(const std::string& socket) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, socket.data(), socket.size());
    if (connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        write(fd_, kChannelHello, kChannelHelloBytes) != kChannelHelloBytes) {
      ADD_FAILURE() << "memory channel to " << socket << ": " << std::strerror(errno);
    }
  }
  ~ChannelWire() { close(fd_); }

  // Sends `request` with sequence `sequence` and returns the response (descriptors that come
  // with it are closed).
  absl::StatusOr<v1::ChannelResponse> Call(v1::ChannelRequest request, uint64_t sequence) {
    request.set_sequence(sequence);
    const std::string body = request.SerializeAsString();
    std::string frame(kFrameHeaderBytes, '\0');
    EncodeFrameHeader(static_cast<uint32_t>(body.size()), frame.data());
    frame += body;
    if (absl::Status s = SendWithFd(fd_, frame, -1, false, "test"); !s.ok()) return s;
    std::string answer;
    int fd = -1;
    if (absl::Status s = ReceiveFrame(fd_, &answer, &fd, "test"); !s.ok()) return s;
    if (fd >= 0) close(fd);
    v1::ChannelResponse response;
    if (!response.ParseFromString(answer)) return absl::InternalError("unparsable response");
    return response;
  }

 private:
  int fd_ = -1;
};

struct ChannelCase {
  const char* label;
  std::function<v1::ChannelRequest()> request;
  absl::StatusCode code;
  std::string message_contains;  // names the field and value
};

v1::ChannelRequest ChannelBindTo(const std::string& session_id) {
  v1::ChannelRequest request;
  request.mutable_bind()->set_session_id(session_id);
  return request;
}

v1::ChannelRequest ChannelSegment(uint64_t instance, uint64_t id, bool writable) {
  v1::ChannelRequest request;
  request.mutable_segment()->set_segment_instance(instance);
  request.mutable_segment()->set_segment_id(id);
  request.mutable_segment()->set_writable(writable);
  return request;
}

v1::ChannelRequest ChannelFastPath(int part) {
  v1::ChannelRequest request;
  request.mutable_fast_path()->set_part(static_cast<v1::FastPathRequest::Part>(part));
  return request;
}

v1::ChannelRequest ChannelCreate(const v1::CreateRequest& create) {
  v1::ChannelRequest request;
  *request.mutable_create() = create;
  return request;
}

v1::ChannelRequest ChannelPublish(const v1::PublishRequest& publish) {
  v1::ChannelRequest request;
  *request.mutable_publish() = publish;
  return request;
}

v1::ChannelRequest ChannelDelete(const std::string& name) {
  v1::ChannelRequest request;
  request.mutable_delete_()->set_name(name);
  return request;
}

// A publish of `tensor_id` as `name` with a stocked-buffer descriptor.
v1::PublishRequest PublishWithDesc(uint64_t tensor_id, const std::string& name, uint32_t code,
                                   uint32_t bits, std::vector<int64_t> shape,
                                   std::vector<int64_t> strides = {}, uint64_t flags = 0) {
  v1::PublishRequest request;
  request.set_tensor_id(tensor_id);
  request.set_name(name);
  v1::TensorDesc* desc = request.mutable_desc();
  desc->mutable_dtype()->set_code(code);
  desc->mutable_dtype()->set_bits(bits);
  desc->mutable_dtype()->set_lanes(1);
  desc->mutable_shape()->Assign(shape.begin(), shape.end());
  desc->mutable_strides()->Assign(strides.begin(), strides.end());
  desc->set_flags(flags);
  return request;
}

class MalformedAdditionsTest : public MalformedRequestTest {
 protected:
  // Nothing of the fixture changed, and the daemon serves a new client end to end.
  void ExpectStillServing(int64_t leases) {
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon_->socket(), "after"});
    ASSERT_TRUE(client.ok()) << client.status();
    tensorshm::StatusOr<ServerStats> stats = (*client)->Stat();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->leases, leases);
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire("fixture/published");
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->dl_tensor.ndim, 1);
    EXPECT_EQ((*t)->dl_tensor.shape[0], 4);
    EXPECT_EQ((*t)->dl_tensor.dtype.code, kDLFloat);
    (*t)->deleter(*t);
    // The other session's unpublished tensor is still its own, and publishes as created.
    EXPECT_TRUE(other_->Publish(foreign_id_, "fixture/foreign").ok());
    t = (*client)->Acquire("fixture/foreign");
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->dl_tensor.dtype.code, kDLInt);
    EXPECT_EQ((*t)->dl_tensor.dtype.bits, 8);
    EXPECT_EQ((*t)->dl_tensor.shape[0], 4);
    (*t)->deleter(*t);
    tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLFloat, 32, 1}, {8}});
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE((*client)->Publish(*w, "after/ok").ok());
  }
};

TEST_F(MalformedAdditionsTest, ChannelRequestsGetTheirCodeAndTheDaemonKeepsServing) {
  ChannelWire channel(daemon_->socket());
  uint64_t sequence = 0;
  auto run = [&](const ChannelCase& c) {
    SCOPED_TRACE(c.label);
    ++sequence;
    absl::StatusOr<v1::ChannelResponse> r = channel.Call(c.request(), sequence);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->sequence(), sequence);
    EXPECT_EQ(r->code(), static_cast<int>(c.code)) << r->message();
    EXPECT_TRUE(absl::StrContains(r->message(), c.message_contains))
        << "message \"" << r->message() << "\" does not name \"" << c.message_contains << "\"";
    if (c.code != absl::StatusCode::kOk) {
      EXPECT_EQ(r->kind_case(), v1::ChannelResponse::KIND_NOT_SET);
    }
  };
  // Before a bind.
  for (const ChannelCase& c : std::vector<ChannelCase>{
           {"no kind", [] { return v1::ChannelRequest(); }, absl::StatusCode::kInvalidArgument,
            "kind: not set"},
           {"segment before bind", [] { return ChannelSegment(1, 1, false); },
            absl::StatusCode::kFailedPrecondition, "bind the channel to a session first"},
           {"create before bind", [] { return ChannelCreate(CreateRequest(kDLFloat, 32, 1, {4})); },
            absl::StatusCode::kFailedPrecondition, "bind the channel to a session first"},
           {"bind to an unknown session", [] { return ChannelBindTo("0123456789abcdef"); },
            absl::StatusCode::kFailedPrecondition, "bind.session_id"},
           {"bind to an empty session id", [] { return ChannelBindTo(""); },
            absl::StatusCode::kFailedPrecondition, "bind.session_id"},
           {"bind", [this] { return ChannelBindTo(wire_->token()); }, absl::StatusCode::kOk, ""},
       }) {
    run(c);
  }
  absl::StatusOr<v1::ChannelResponse> bound = channel.Call(ChannelFastPath(1), ++sequence);
  ASSERT_TRUE(bound.ok() && bound->code() == 0) << (bound.ok() ? bound->message() : "");
  const uint64_t instance = bound->fast_path().instance_id();
  const uint64_t unpublished = unpublished_id_;
  const uint64_t published = published_id_;
  const uint64_t foreign = foreign_id_;
  const std::vector<ChannelCase> cases = {
      {"bind twice", [this] { return ChannelBindTo(wire_->token()); },
       absl::StatusCode::kFailedPrecondition, "bound to a session already"},
      {"segment id 0", [=] { return ChannelSegment(instance, 0, false); },
       absl::StatusCode::kNotFound, "segment.segment_id = 0"},
      {"segment id 2^64-1", [=] { return ChannelSegment(instance, ~uint64_t{0}, false); },
       absl::StatusCode::kNotFound, "segment.segment_id = 18446744073709551615"},
      {"segment of another instance", [=] { return ChannelSegment(instance ^ 1, 1, true); },
       absl::StatusCode::kFailedPrecondition,
       absl::StrCat("segment.segment_instance = ", instance ^ 1)},
      {"fast path part unspecified", [] { return ChannelFastPath(0); },
       absl::StatusCode::kInvalidArgument, "fast_path.part = 0"},
      {"fast path part 99", [] { return ChannelFastPath(99); }, absl::StatusCode::kInvalidArgument,
       "fast_path.part = 99"},
      {"fast path part -1", [] { return ChannelFastPath(-1); }, absl::StatusCode::kInvalidArgument,
       "fast_path.part = -1"},
      {"create: dtype code unknown", [] { return ChannelCreate(CreateRequest(99, 32, 1, {4})); },
       absl::StatusCode::kInvalidArgument, "code: 99"},
      {"create: 33 dimensions",
       [] { return ChannelCreate(CreateRequest(kDLFloat, 32, 1, std::vector<int64_t>(33, 1))); },
       absl::StatusCode::kInvalidArgument, "33 dimensions"},
      {"create: negative dimension",
       [] { return ChannelCreate(CreateRequest(kDLFloat, 32, 1, {-7})); },
       absl::StatusCode::kInvalidArgument, "shape[0] = -7"},
      {"create: larger than the pool",
       [] { return ChannelCreate(CreateRequest(kDLUInt, 8, 1, {int64_t{1} << 30})); },
       absl::StatusCode::kResourceExhausted, "1073741824 bytes"},
      {"create: device uuid for a host device",
       [] {
         v1::CreateRequest create = CreateRequest(kDLFloat, 32, 1, {4});
         create.set_device_uuid(std::string(16, 'u'));
         return ChannelCreate(create);
       },
       absl::StatusCode::kInvalidArgument, "only CUDA devices take one"},
      {"publish: unknown tensor",
       [] {
         v1::PublishRequest publish;
         publish.set_tensor_id(987654321);
         publish.set_name("x");
         return ChannelPublish(publish);
       },
       absl::StatusCode::kNotFound, "tensor_id = 987654321"},
      {"publish: bad name",
       [=] {
         v1::PublishRequest publish;
         publish.set_tensor_id(unpublished);
         publish.set_name("/abs");
         return ChannelPublish(publish);
       },
       absl::StatusCode::kInvalidArgument, "name = \"/abs\""},
      {"publish: another session's tensor",
       [=] {
         v1::PublishRequest publish;
         publish.set_tensor_id(foreign);
         publish.set_name("stolen");
         publish.set_acquire(true);
         return ChannelPublish(publish);
       },
       absl::StatusCode::kPermissionDenied, std::to_string(foreign)},
      {"publish: twice",
       [=] {
         v1::PublishRequest publish;
         publish.set_tensor_id(published);
         publish.set_name("again");
         publish.set_acquire(true);
         return ChannelPublish(publish);
       },
       absl::StatusCode::kFailedPrecondition, "already published"},
      {"publish: desc dtype code unknown",
       [=] { return ChannelPublish(PublishWithDesc(unpublished, "d", 99, 8, {4})); },
       absl::StatusCode::kInvalidArgument, "code: 99"},
      {"publish: desc larger than the buffer",
       [=] { return ChannelPublish(PublishWithDesc(unpublished, "d", kDLFloat, 32, {1 << 20})); },
       absl::StatusCode::kInvalidArgument, "desc: 4194304 bytes do not fit"},
      {"publish: desc with a negative dimension",
       [=] {
         return ChannelPublish(PublishWithDesc(unpublished, "d", kDLFloat, 32, {2, -5}));
       },
       absl::StatusCode::kInvalidArgument, "shape[1] = -5"},
      {"publish: desc on another session's tensor",
       [=] { return ChannelPublish(PublishWithDesc(foreign, "d", kDLUInt, 8, {1})); },
       absl::StatusCode::kPermissionDenied, absl::StrCat("tensor_id = ", foreign)},
      {"publish: ready event of the wrong size",
       [=] {
         v1::PublishRequest publish;
         publish.set_tensor_id(unpublished);
         publish.set_name("evt");
         publish.set_ready_event(std::string(65, 'e'));
         return ChannelPublish(publish);
       },
       absl::StatusCode::kInvalidArgument, "ready_event: 65 bytes"},
      {"delete: name with an empty element", [] { return ChannelDelete("a//b"); },
       absl::StatusCode::kInvalidArgument, "name = \"a//b\""},
      {"delete: name with a NUL byte", [] { return ChannelDelete(std::string("a\0b", 3)); },
       absl::StatusCode::kInvalidArgument, "byte 1"},
      {"delete: unbound name", [] { return ChannelDelete("nothing/here"); },
       absl::StatusCode::kNotFound, "name = \"nothing/here\""},
  };
  for (const ChannelCase& c : cases) run(c);

  // A create asking for more stock than the daemon makes gets at most its cap, no error.
  v1::CreateRequest create = CreateRequest(kDLUInt, 8, 1, {4096});
  create.set_stock(~uint32_t{0});
  absl::StatusOr<v1::ChannelResponse> created = channel.Call(ChannelCreate(create), ++sequence);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_EQ(created->code(), 0) << created->message();
  std::cout << "create with stock = 4294967295: " << created->created().stocked_size()
            << " buffers stocked\n";
  EXPECT_LE(created->created().stocked_size(), 64);
  // The unpublished fixture tensor was left as created by every refused desc.
  v1::PublishRequest publish;
  publish.set_tensor_id(unpublished_id_);
  publish.set_name("fixture/second");
  publish.set_acquire(true);
  absl::StatusOr<v1::ChannelResponse> second = channel.Call(ChannelPublish(publish), ++sequence);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->code(), 0) << second->message();
  EXPECT_EQ(second->published().acquired().desc().shape_size(), 1);
  EXPECT_EQ(second->published().acquired().desc().shape(0), 4);
  EXPECT_EQ(second->published().acquired().desc().nbytes(), 16);
  // The one lease: the publish-and-acquire just now (the refused ones took none).
  ExpectStillServing(/*leases=*/1);
}

TEST_F(MalformedAdditionsTest, NewRpcFieldsGetTheirCodeAndTheDaemonKeepsServing) {
  const std::vector<Case> cases = {
      {"desc: dtype code unknown",
       [this](Wire& w) { return w.Publish(PublishWithDesc(unpublished_id_, "d", 99, 8, {4})); },
       StatusCode::INVALID_ARGUMENT, "code: 99"},
      {"desc: opaque handle",
       [this](Wire& w) {
         return w.Publish(PublishWithDesc(unpublished_id_, "d", kDLOpaqueHandle, 64, {1}));
       },
       StatusCode::INVALID_ARGUMENT, "opaque handle"},
      {"desc: larger than the buffer",
       [this](Wire& w) {
         // Beyond the buffer (a page), not only beyond the 16 bytes created.
         return w.Publish(PublishWithDesc(unpublished_id_, "d", kDLFloat, 64, {1000}));
       },
       StatusCode::INVALID_ARGUMENT, "desc: 8000 bytes do not fit"},
      {"desc: 33 dimensions",
       [this](Wire& w) {
         return w.Publish(
             PublishWithDesc(unpublished_id_, "d", kDLUInt, 8, std::vector<int64_t>(33, 1)));
       },
       StatusCode::INVALID_ARGUMENT, "33 dimensions"},
      {"desc: element count overflows",
       [this](Wire& w) {
         return w.Publish(PublishWithDesc(unpublished_id_, "d", kDLUInt, 8,
                                          {int64_t{1} << 40, int64_t{1} << 40}));
       },
       StatusCode::INVALID_ARGUMENT, "overflows"},
      {"desc: strides count differs from ndim",
       [this](Wire& w) {
         return w.Publish(PublishWithDesc(unpublished_id_, "d", kDLUInt, 8, {2, 2}, {1}));
       },
       StatusCode::INVALID_ARGUMENT, "strides = [1]"},
      {"desc: strides reaching outside the buffer",
       [this](Wire& w) {
         return w.Publish(PublishWithDesc(unpublished_id_, "d", kDLUInt, 8, {2, 2}, {10000, 1}));
       },
       StatusCode::INVALID_ARGUMENT, "do not fit"},
      {"desc: negative stride past the buffer's start",
       [this](Wire& w) {
         return w.Publish(PublishWithDesc(unpublished_id_, "d", kDLUInt, 8, {8}, {-1000}));
       },
       StatusCode::INVALID_ARGUMENT, "do not fit"},
      {"desc: padded flag for a whole-byte dtype",
       [this](Wire& w) {
         return w.Publish(PublishWithDesc(unpublished_id_, "d", kDLFloat, 32, {2}, {},
                                          DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED));
       },
       StatusCode::INVALID_ARGUMENT, "subbyte_padded: dtype float32"},
      {"desc: on a published tensor",
       [this](Wire& w) { return w.Publish(PublishWithDesc(published_id_, "d", kDLUInt, 8, {1})); },
       StatusCode::FAILED_PRECONDITION, "already published"},
      {"desc: on another session's tensor",
       [this](Wire& w) { return w.Publish(PublishWithDesc(foreign_id_, "d", kDLUInt, 8, {1})); },
       StatusCode::PERMISSION_DENIED, absl::StrCat("tensor_id = ", foreign_id_)},
      {"acquire with a publish onto a bound name",
       [this](Wire& w) {
         v1::PublishRequest request;
         request.set_tensor_id(unpublished_id_);
         request.set_name("fixture/published");
         request.set_acquire(true);
         request.set_stock(64);
         request.set_stock_bytes(4096);
         return w.Publish(request);
       },
       StatusCode::ALREADY_EXISTS, "name = \"fixture/published\""},
      {"acquire with a publish of another session's tensor",
       [this](Wire& w) {
         v1::PublishRequest request;
         request.set_tensor_id(foreign_id_);
         request.set_name("stolen");
         request.set_acquire(true);
         return w.Publish(request);
       },
       StatusCode::PERMISSION_DENIED, std::to_string(foreign_id_)},
      {"release the same lease twice in one batch",
       [](Wire& w) {
         v1::AcquireRequest request;
         request.set_name("fixture/published");
         v1::AcquireResponse acquired;
         grpc::Status status = w.stub().Acquire(w.Context().get(), request, &acquired);
         if (!status.ok()) return status;
         v1::ReleaseBatch batch;
         batch.add_lease_ids(acquired.lease_id());
         batch.add_lease_ids(acquired.lease_id());
         return w.Release(batch);
       },
       StatusCode::FAILED_PRECONDITION, "lease_ids[1] = "},
      {"abandon a published tensor",
       [this](Wire& w) {
         v1::ReleaseBatch batch;
         batch.add_abandoned_tensor_ids(published_id_);
         return w.Release(batch);
       },
       StatusCode::FAILED_PRECONDITION, absl::StrCat("abandoned_tensor_ids[0] = ", published_id_)},
      {"abandon an unknown tensor",
       [](Wire& w) {
         v1::ReleaseBatch batch;
         batch.add_abandoned_tensor_ids(0);
         batch.add_abandoned_tensor_ids(~uint64_t{0});
         return w.Release(batch);
       },
       StatusCode::FAILED_PRECONDITION, "abandoned_tensor_ids[0] = 0"},
      {"a second open on a session stream",
       [](Wire& w) {
         grpc::ClientContext context;
         auto stream = w.stub().Session(&context);
         v1::SessionRequest open;
         open.mutable_open()->set_client_name("twice");
         v1::SessionResponse opened;
         if (!stream->Write(open) || !stream->Read(&opened)) return stream->Finish();
         stream->Write(open);
         stream->WritesDone();
         return stream->Finish();
       },
       StatusCode::INVALID_ARGUMENT, "only `release` messages"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    grpc::Status status = c.call(*wire_);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), c.message_contains))
        << "message \"" << status.error_message() << "\" does not name \"" << c.message_contains
        << "\"";
  }

  // Stock beyond what the daemon makes is capped, never an error.
  v1::CreateResponse created;
  v1::CreateRequest create = CreateRequest(kDLUInt, 8, 1, {100});
  create.set_stock(~uint32_t{0});
  ASSERT_TRUE(wire_->Create(create, SessionKind::kValid, &created).ok());
  EXPECT_LE(created.stocked_size(), 64);
  v1::PublishRequest request;
  request.set_tensor_id(created.tensor_id());
  request.set_name("stock/huge");
  request.set_stock(~uint32_t{0});
  request.set_stock_bytes(uint64_t{1} << 63);
  v1::PublishResponse published;
  grpc::Status status = wire_->Publish(request, &published);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(published.stocked_size(), 0);

  // A ReleaseBatch echoes any sequence. One of 16384 ids the session does not hold gets a
  // rejection each; one of hundreds of thousands (whose rejections would be tens of megabytes)
  // is refused whole. Neither breaks the stream or the daemon.
  v1::ReleaseBatch batch;
  batch.set_sequence(~uint64_t{0});
  for (uint64_t id = 1; id <= 16384; ++id) batch.add_lease_ids(id << 20);
  absl::StatusOr<v1::ReleaseAck> ack = wire_->ReleaseAck(batch);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->sequence(), ~uint64_t{0});
  ASSERT_EQ(ack->rejected_size(), 16384);
  EXPECT_TRUE(absl::StrContains(ack->rejected(0).message(), "lease_ids[0] = 1048576"));
  for (uint64_t id = 16385; id <= 300000; ++id) batch.add_lease_ids(id);
  batch.add_abandoned_tensor_ids(unpublished_id_);
  ack = wire_->ReleaseAck(batch);
  ASSERT_TRUE(ack.ok()) << ack.status();
  std::cout << "release batch of 300000 lease ids: " << ack->rejected_size()
            << " rejection: " << ack->rejected(0).message() << "\n";
  ASSERT_EQ(ack->rejected_size(), 1);
  EXPECT_EQ(ack->rejected(0).code(), static_cast<int>(StatusCode::INVALID_ARGUMENT));
  EXPECT_TRUE(absl::StrContains(ack->rejected(0).message(), "lease_ids: 300000 ids"));
  EXPECT_TRUE(absl::StrContains(ack->rejected(0).message(), "at most 16384"));
  // The stream still serves.
  v1::ReleaseBatch empty;
  empty.set_sequence(7);
  ack = wire_->ReleaseAck(empty);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->sequence(), 7u);
  EXPECT_EQ(ack->rejected_size(), 0);

  // Nothing of the refused batch was applied: the unpublished tensor in it is still ours.
  EXPECT_TRUE(wire_->Publish(unpublished_id_, "fixture/second").ok());
  // The lease of the "release twice" case was given back by its first id.
  ExpectStillServing(/*leases=*/0);
}

TEST_F(MalformedAdditionsTest, SessionOpenListsAreAnsweredAndTakeNothing) {
  // Outside a restart's grace period a reattach takes nothing back, whatever the lists say,
  // however long they are: the answer has one entry per id, all refused, and nothing of the
  // fixture's changes hands.
  // (200,000 is below --uid-leases' default, which bounds a held list; past it see below.)
  for (const int count : {3, 200000}) {
    SCOPED_TRACE(count);
    grpc::ClientContext context;
    auto stream = wire_->stub().Session(&context);
    v1::SessionRequest open;
    open.mutable_open()->set_pid(-1);
    open.mutable_open()->set_client_name(std::string("line\nbreak\0nul", 14));
    for (int i = 0; i < count; ++i) {
      const uint64_t id = i % 3 == 0   ? published_id_
                          : i % 3 == 1 ? foreign_id_
                                       : ~uint64_t{0} - static_cast<uint64_t>(i);
      open.mutable_open()->add_held_tensor_ids(id);
      open.mutable_open()->add_unpublished_tensor_ids(i % 2 == 0 ? foreign_id_ : unpublished_id_);
    }
    std::cout << "session open with " << count << " held and " << count
              << " unpublished ids: " << open.ByteSizeLong() << " bytes\n";
    ASSERT_TRUE(stream->Write(open));
    v1::SessionResponse opened;
    ASSERT_TRUE(stream->Read(&opened));
    ASSERT_TRUE(opened.has_opened());
    ASSERT_EQ(opened.opened().lease_ids_size(), count);
    ASSERT_EQ(opened.opened().readopted_size(), count);
    for (int i = 0; i < count; ++i) {
      ASSERT_EQ(opened.opened().lease_ids(i), 0u) << i;
      ASSERT_FALSE(opened.opened().readopted(i)) << i;
    }
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  // A held list longer than one uid may hold leases is refused whole, naming the flag.
  {
    grpc::ClientContext context;
    auto stream = wire_->stub().Session(&context);
    v1::SessionRequest open;
    open.mutable_open()->set_pid(-1);
    for (int i = 0; i < 300000; ++i) open.mutable_open()->add_held_tensor_ids(published_id_);
    ASSERT_TRUE(stream->Write(open));
    v1::SessionResponse opened;
    EXPECT_FALSE(stream->Read(&opened));
    const grpc::Status status = stream->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), "open.held_tensor_ids: 300000"))
        << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), "--uid-leases"))
        << status.error_message();
  }
  // A held id on the fixture's published tensor took no lease; the unpublished ones are still
  // their sessions' own.
  EXPECT_TRUE(wire_->Publish(unpublished_id_, "fixture/second").ok());
  ExpectStillServing(/*leases=*/0);
}
}  // namespace
}  // namespace tensorshm::testing
