// Test helpers that speak the wire protocol through the generated gRPC stub: a session stream
// of one's own, and Acquire calls left in flight.
#ifndef TENSORSHM_TESTS_SUPPORT_RAW_SESSION_H_
#define TENSORSHM_TESTS_SUPPORT_RAW_SESSION_H_

#include <dlpack/dlpack.h>
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm::testing {

// A raw gRPC connection with its own session stream.
class RawSession {
 public:
  explicit RawSession(const std::string& socket, const std::string& client_name = "raw_session")
      : channel_(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials())),
        stub_(v1::TensorShm::NewStub(channel_)) {
    stream_ = stub_->Session(&stream_context_);
    v1::SessionRequest open;
    open.mutable_open()->set_pid(getpid());
    open.mutable_open()->set_client_name(client_name);
    v1::SessionResponse opened;
    if (stream_->Write(open) && stream_->Read(&opened)) token_ = opened.opened().session_id();
  }
  ~RawSession() { Close(); }

  // Ends the session stream (the daemon then closes the session).
  void Close() {
    if (stream_ == nullptr) return;
    stream_->WritesDone();
    stream_->Finish().ok();
    stream_.reset();
  }

  void Prepare(grpc::ClientContext* context,
               std::chrono::milliseconds deadline = std::chrono::seconds(60)) const {
    context->set_deadline(std::chrono::system_clock::now() + deadline);
    context->AddMetadata("tensorshm-session", token_);
  }

  // Creates a uint8 tensor of `bytes` bytes over gRPC.
  grpc::Status Create(int64_t bytes, v1::CreateResponse* created) {
    v1::CreateRequest create;
    create.mutable_dtype()->set_code(kDLUInt);
    create.mutable_dtype()->set_bits(8);
    create.mutable_dtype()->set_lanes(1);
    create.add_shape(bytes);
    grpc::ClientContext context;
    Prepare(&context);
    return stub_->Create(&context, create, created);
  }

  // Publishes tensor `tensor_id` as `name` over gRPC.
  grpc::Status PublishTensor(uint64_t tensor_id, const std::string& name, bool replace = false) {
    v1::PublishRequest publish;
    publish.set_tensor_id(tensor_id);
    publish.set_name(name);
    publish.set_replace(replace);
    v1::PublishResponse published;
    grpc::ClientContext publish_context;
    Prepare(&publish_context);
    return stub_->Publish(&publish_context, publish, &published);
  }

  // Creates a 64-byte tensor and publishes it as `name` over gRPC; returns its id (0 on failure).
  uint64_t Publish(const std::string& name, bool replace = false) {
    v1::CreateResponse created;
    if (!Create(64, &created).ok()) return 0;
    if (!PublishTensor(created.tensor_id(), name, replace).ok()) return 0;
    return created.tensor_id();
  }

  // Sends a ReleaseBatch settling `request_ids` (ReleaseBatch.settled_request_ids) and waits for
  // its acknowledgement; false if the stream broke.
  bool Settle(const std::vector<uint64_t>& request_ids) {
    v1::SessionRequest request;
    request.mutable_release()->set_sequence(++sequence_);
    for (uint64_t id : request_ids) request.mutable_release()->add_settled_request_ids(id);
    v1::SessionResponse ack;
    return stream_ != nullptr && stream_->Write(request) && stream_->Read(&ack) && ack.has_ack();
  }

  const std::string& token() const { return token_; }
  v1::TensorShm::Stub& stub() { return *stub_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TensorShm::Stub> stub_;
  grpc::ClientContext stream_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  std::string token_;
  uint64_t sequence_ = 0;
};

// One Acquire in flight (gRPC's callback stub); Wait returns its status.
class PendingAcquire {
 public:
  PendingAcquire(RawSession& session, const std::string& name, int64_t wait_ms,
                 std::chrono::milliseconds deadline = std::chrono::seconds(60),
                 uint64_t request_id = 0) {
    session.Prepare(&context_, deadline);
    request_.set_name(name);
    request_.set_wait_ms(wait_ms);
    request_.set_request_id(request_id);
    session.stub().async()->Acquire(&context_, &request_, &response_, [this](grpc::Status s) {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(s);
      ++answers_;
      done_.notify_all();
    });
  }
  ~PendingAcquire() {
    context_.TryCancel();
    Wait(absl::Seconds(30));
  }

  // The status, or UNKNOWN "no answer" if none came within `timeout`.
  grpc::Status Wait(absl::Duration timeout = absl::Seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!done_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] { return answers_ > 0; })) {
      return grpc::Status(grpc::StatusCode::UNKNOWN, "no answer");
    }
    return status_;
  }
  // Whether an answer came (without waiting).
  bool answered() {
    std::lock_guard<std::mutex> lock(mu_);
    return answers_ > 0;
  }
  void Cancel() { context_.TryCancel(); }
  const v1::AcquireResponse& response() const { return response_; }

 private:
  grpc::ClientContext context_;
  v1::AcquireRequest request_;
  v1::AcquireResponse response_;
  std::mutex mu_;
  std::condition_variable done_;
  grpc::Status status_;
  int answers_ = 0;
};

}  // namespace tensorshm::testing

#endif  // TENSORSHM_TESTS_SUPPORT_RAW_SESSION_H_
