// tsm_uid_client: drives the per-uid limits (--uid-*) through the raw gRPC stub, as one uid
// (tests/integration/uid_limits_integration_test.cc runs it as uid 65534 and as the daemon's own
// uid).
//
//   tsm_uid_client sessions SOCKET --count N
//       opens up to N sessions; prints "opened K", then "refused CODE MESSAGE" if one was refused
//   tsm_uid_client leases SOCKET NAME --count N
//       one session acquires NAME (no wait) up to N times; prints "leased K", and on a refusal
//       "refused CODE MESSAGE", then tries to publish a new tensor as NAME-pa with acquire
//       ("publish-acquire CODE MESSAGE"), releases one lease and acquires NAME again
//       ("after release CODE")
//   tsm_uid_client waiters SOCKET NAME --count N
//       one session starts N acquires of NAME waiting up to 120 s (each waits again if refused);
//       then, until refused (at most 400 tries), an acquire of NAME-probe waiting 50 ms: "refused
//       CODE MESSAGE" (or "never refused"); prints "waiting", then "woken K of N ok" once the N
//       calls returned, then "rewait CODE" for one more waiting acquire of NAME-probe
//   tsm_uid_client quota SOCKET NAME --bytes B
//       session a: a 4096-byte create asking for 8 stocked buffers ("stocked K"), abandoned;
//       then B bytes in session a ("create a CODE") and B bytes in session b ("create b CODE
//       MESSAGE"); publishes a's as NAME and creates B in b again ("after publish CODE");
//       abandons b's and creates B in b again ("after abandon CODE")
//   tsm_uid_client create SOCKET --bytes B --count N
//       one session creates N unpublished tensors of B bytes: "created ID" for each
//   tsm_uid_client reattach SOCKET --id T --lists L1,L2,... [--unpublished U1,U2,...]
//       per entry, a new session whose SessionOpen lists tensor T in held_tensor_ids L times
//       (the first one also the unpublished tensors U1, ...): "reattach L: lease_ids A,B,..."
//       (and "readopted 1,0,...") or "reattach L: refused CODE MESSAGE"; an entry "r" releases
//       one lease of the first session ("released CODE")
//
// Common flags: --as-uid U (drop to uid and gid U first; needs root), --hold (print "holding"
// at the end and keep every session open until killed). Exit 0, or 2 for bad usage, 3 if the
// daemon cannot be reached, 4 if dropping privileges failed.
#include <grp.h>
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace {

namespace v1 = tensorshm::v1;
using Stream = grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>;

std::string Describe(const grpc::Status& status) {
  return std::to_string(static_cast<int>(status.error_code())) + " " + status.error_message();
}

// One session: its stream stays open as long as the object lives.
class RawSession {
 public:
  // Opens a session on `stub`, with `held` as SessionOpen.held_tensor_ids. The status is the
  // stream's if the daemon refused it.
  RawSession(v1::TensorShm::Stub& stub, const std::vector<uint64_t>& held = {},
             const std::vector<uint64_t>& unpublished = {})
      : stub_(stub) {
    stream_ = stub_.Session(&context_);
    v1::SessionRequest open;
    open.mutable_open()->set_pid(getpid());
    open.mutable_open()->set_client_name("tsm_uid_client");
    for (uint64_t id : held) open.mutable_open()->add_held_tensor_ids(id);
    for (uint64_t id : unpublished) open.mutable_open()->add_unpublished_tensor_ids(id);
    v1::SessionResponse opened;
    if (stream_->Write(open) && stream_->Read(&opened) && opened.has_opened()) {
      opened_ = opened.opened();
      return;
    }
    stream_->WritesDone();
    status_ = stream_->Finish();
    if (status_.ok()) status_ = grpc::Status(grpc::StatusCode::UNKNOWN, "stream ended");
    stream_.reset();
  }
  ~RawSession() {
    if (stream_ == nullptr) return;
    stream_->WritesDone();
    stream_->Finish();
  }

  bool ok() const { return stream_ != nullptr; }
  const grpc::Status& status() const { return status_; }
  const v1::SessionOpened& opened() const { return opened_; }

  std::unique_ptr<grpc::ClientContext> Context(std::chrono::seconds timeout) const {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + timeout);
    context->AddMetadata("tensorshm-session", opened_.session_id());
    return context;
  }

  grpc::Status Acquire(const std::string& name, int64_t wait_ms, uint64_t* lease_id = nullptr) {
    v1::AcquireRequest request;
    request.set_name(name);
    request.set_wait_ms(wait_ms);
    v1::AcquireResponse response;
    grpc::Status status =
        stub_.Acquire(Context(std::chrono::seconds(180)).get(), request, &response);
    if (lease_id != nullptr) *lease_id = response.lease_id();
    return status;
  }

  // A uint8 tensor of `bytes`; `stocked` gets the number of stocked buffers made with it.
  grpc::Status Create(int64_t bytes, uint64_t* tensor_id, uint32_t stock = 0,
                      std::vector<uint64_t>* stocked = nullptr) {
    v1::CreateRequest request;
    request.mutable_dtype()->set_code(1);  // kDLUInt
    request.mutable_dtype()->set_bits(8);
    request.mutable_dtype()->set_lanes(1);
    request.add_shape(bytes);
    request.set_stock(stock);
    v1::CreateResponse response;
    grpc::Status status = stub_.Create(Context(std::chrono::seconds(30)).get(), request, &response);
    *tensor_id = response.tensor_id();
    if (stocked != nullptr) {
      for (const v1::StockedBuffer& buffer : response.stocked()) {
        stocked->push_back(buffer.tensor_id());
      }
    }
    return status;
  }

  grpc::Status Publish(uint64_t tensor_id, const std::string& name, bool acquire) {
    v1::PublishRequest request;
    request.set_tensor_id(tensor_id);
    request.set_name(name);
    request.set_acquire(acquire);
    v1::PublishResponse response;
    return stub_.Publish(Context(std::chrono::seconds(30)).get(), request, &response);
  }

  // Sends one release batch; the status is its first rejection.
  grpc::Status Release(const std::vector<uint64_t>& lease_ids,
                       const std::vector<uint64_t>& abandoned_tensor_ids) {
    v1::SessionRequest request;
    request.mutable_release()->set_sequence(++sequence_);
    for (uint64_t id : lease_ids) request.mutable_release()->add_lease_ids(id);
    for (uint64_t id : abandoned_tensor_ids) {
      request.mutable_release()->add_abandoned_tensor_ids(id);
    }
    v1::SessionResponse response;
    if (!stream_->Write(request) || !stream_->Read(&response)) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "session stream broke");
    }
    if (response.ack().rejected_size() == 0) return grpc::Status::OK;
    const v1::Rejection& rejection = response.ack().rejected(0);
    return grpc::Status(static_cast<grpc::StatusCode>(rejection.code()), rejection.message());
  }

 private:
  v1::TensorShm::Stub& stub_;
  grpc::ClientContext context_;
  std::unique_ptr<Stream> stream_;
  grpc::Status status_;
  v1::SessionOpened opened_;
  uint64_t sequence_ = 0;
};

using Sessions = std::vector<std::unique_ptr<RawSession>>;

void OpenSessions(v1::TensorShm::Stub& stub, int64_t count, Sessions& sessions) {
  for (int64_t i = 0; i < count; ++i) {
    auto session = std::make_unique<RawSession>(stub);
    if (!session->ok()) {
      std::cout << "opened " << sessions.size() << "\nrefused " << Describe(session->status())
                << std::endl;
      return;
    }
    sessions.push_back(std::move(session));
  }
  std::cout << "opened " << sessions.size() << std::endl;
}

int Leases(v1::TensorShm::Stub& stub, const std::string& name, int64_t count, Sessions& sessions) {
  sessions.push_back(std::make_unique<RawSession>(stub));
  RawSession& session = *sessions.back();
  if (!session.ok()) {
    std::cout << "session refused " << Describe(session.status()) << std::endl;
    return 3;
  }
  std::vector<uint64_t> leases;
  grpc::Status refused;
  for (int64_t i = 0; i < count; ++i) {
    uint64_t lease = 0;
    refused = session.Acquire(name, 0, &lease);
    if (!refused.ok()) break;
    leases.push_back(lease);
  }
  std::cout << "leased " << leases.size() << std::endl;
  if (refused.ok()) return 0;
  std::cout << "refused " << Describe(refused) << std::endl;
  uint64_t tensor_id = 0;
  grpc::Status created = session.Create(64, &tensor_id);
  std::cout << "publish-acquire "
            << Describe(created.ok() ? session.Publish(tensor_id, name + "-pa", true) : created)
            << std::endl;
  if (!leases.empty()) {
    grpc::Status released = session.Release({leases.back()}, {});
    if (!released.ok()) std::cout << "release " << Describe(released) << std::endl;
  }
  std::cout << "after release " << Describe(session.Acquire(name, 0)) << std::endl;
  return 0;
}

int Waiters(v1::TensorShm::Stub& stub, const std::string& name, int64_t count, Sessions& sessions) {
  sessions.push_back(std::make_unique<RawSession>(stub));
  RawSession& session = *sessions.back();
  if (!session.ok()) {
    std::cout << "session refused " << Describe(session.status()) << std::endl;
    return 3;
  }
  std::vector<grpc::Status> results(count);
  std::vector<std::thread> threads;
  for (int64_t i = 0; i < count; ++i) {
    threads.emplace_back([&, i] {
      // A probe below may hold a waiter's place for a moment: then wait again.
      do {
        results[i] = session.Acquire(name, 120000);
        if (results[i].error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      } while (results[i].error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    });
  }
  // The waiters register in the daemon in their own time: probe, one at a time, until a probe
  // is refused, which means that the N waiters hold every place.
  bool refused = false;
  for (int attempt = 0; attempt < 400 && !refused; ++attempt) {
    grpc::Status probe = session.Acquire(name + "-probe", 50);
    if (probe.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      std::cout << "refused " << Describe(probe) << std::endl;
      refused = true;
    }
  }
  if (!refused) std::cout << "never refused" << std::endl;
  std::cout << "waiting" << std::endl;
  for (std::thread& thread : threads) thread.join();
  int ok = 0;
  for (const grpc::Status& result : results) {
    if (result.ok()) {
      ++ok;
    } else {
      std::cout << "waiter " << Describe(result) << std::endl;
    }
  }
  std::cout << "woken " << ok << " of " << count << " ok" << std::endl;
  std::cout << "rewait " << Describe(session.Acquire(name + "-probe", 50)) << std::endl;
  return 0;
}

int Quota(v1::TensorShm::Stub& stub, const std::string& name, int64_t bytes, Sessions& sessions) {
  sessions.push_back(std::make_unique<RawSession>(stub));
  sessions.push_back(std::make_unique<RawSession>(stub));
  RawSession& a = *sessions[sessions.size() - 2];
  RawSession& b = *sessions.back();
  if (!a.ok() || !b.ok()) {
    std::cout << "session refused " << Describe(a.ok() ? b.status() : a.status()) << std::endl;
    return 3;
  }
  uint64_t small = 0;
  std::vector<uint64_t> stocked;
  grpc::Status status = a.Create(4096, &small, 8, &stocked);
  std::cout << "stocked " << stocked.size() << " (create " << Describe(status) << ")" << std::endl;
  if (status.ok()) stocked.push_back(small);
  if (grpc::Status s = a.Release({}, stocked); !s.ok()) {
    std::cout << "abandon " << Describe(s) << std::endl;
  }
  uint64_t in_a = 0;
  uint64_t in_b = 0;
  std::cout << "create a " << Describe(a.Create(bytes, &in_a)) << std::endl;
  std::cout << "create b " << Describe(b.Create(bytes, &in_b)) << std::endl;
  if (grpc::Status s = a.Publish(in_a, name, false); !s.ok()) {
    std::cout << "publish " << Describe(s) << std::endl;
  }
  std::cout << "after publish " << Describe(b.Create(bytes, &in_b)) << std::endl;
  if (grpc::Status s = b.Release({}, {in_b}); !s.ok()) {
    std::cout << "abandon " << Describe(s) << std::endl;
  }
  std::cout << "after abandon " << Describe(b.Create(bytes, &in_b)) << std::endl;
  return 0;
}

int Create(v1::TensorShm::Stub& stub, int64_t bytes, int64_t count, Sessions& sessions) {
  sessions.push_back(std::make_unique<RawSession>(stub));
  RawSession& session = *sessions.back();
  if (!session.ok()) {
    std::cout << "session refused " << Describe(session.status()) << std::endl;
    return 3;
  }
  for (int64_t i = 0; i < count; ++i) {
    uint64_t tensor_id = 0;
    grpc::Status status = session.Create(bytes, &tensor_id);
    if (!status.ok()) {
      std::cout << "create " << Describe(status) << std::endl;
      return 3;
    }
    std::cout << "created " << tensor_id << std::endl;
  }
  return 0;
}

int Reattach(v1::TensorShm::Stub& stub, uint64_t tensor_id, const std::string& lists,
             const std::vector<uint64_t>& unpublished, Sessions& sessions) {
  for (absl::string_view entry : absl::StrSplit(lists, ',')) {
    if (entry == "r") {
      const bool held = !sessions.empty() && sessions.front()->opened().lease_ids_size() > 0;
      std::cout << "released "
                << (held ? Describe(sessions.front()->Release(
                               {sessions.front()->opened().lease_ids(0)}, {}))
                         : std::string("nothing"))
                << std::endl;
      continue;
    }
    int64_t length = 0;
    if (!absl::SimpleAtoi(entry, &length) || length < 0) return 2;
    auto session =
        std::make_unique<RawSession>(stub, std::vector<uint64_t>(length, tensor_id),
                                     sessions.empty() ? unpublished : std::vector<uint64_t>());
    if (!session->ok()) {
      std::cout << "reattach " << length << ": refused " << Describe(session->status())
                << std::endl;
      continue;
    }
    std::cout << "reattach " << length << ": lease_ids "
              << absl::StrJoin(session->opened().lease_ids(), ",") << std::endl;
    if (session->opened().readopted_size() > 0) {
      std::vector<int> readopted(session->opened().readopted().begin(),
                                 session->opened().readopted().end());
      std::cout << "readopted " << absl::StrJoin(readopted, ",") << std::endl;
    }
    sessions.push_back(std::move(session));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: tsm_uid_client MODE SOCKET [NAME] [flags] (see the source)\n";
    return 2;
  }
  const std::string mode = argv[1];
  const std::string socket = argv[2];
  std::string name;
  int64_t count = 0, bytes = 0, as_uid = -1;
  uint64_t id = 0;
  std::string lists;
  std::vector<uint64_t> unpublished;
  bool hold = false;
  for (int i = 3; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    bool parsed = true;
    if (arg == "--count") {
      parsed = absl::SimpleAtoi(value(), &count);
    } else if (arg == "--bytes") {
      parsed = absl::SimpleAtoi(value(), &bytes);
    } else if (arg == "--as-uid") {
      parsed = absl::SimpleAtoi(value(), &as_uid);
    } else if (arg == "--id") {
      parsed = absl::SimpleAtoi(value(), &id);
    } else if (arg == "--lists") {
      lists = value();
    } else if (arg == "--unpublished") {
      for (absl::string_view text : absl::StrSplit(value(), ',')) {
        uint64_t tensor_id = 0;
        parsed = parsed && absl::SimpleAtoi(text, &tensor_id);
        unpublished.push_back(tensor_id);
      }
    } else if (arg == "--hold") {
      hold = true;
    } else {
      name = arg;
    }
    if (!parsed) {
      std::cerr << arg << ": expected a number\n";
      return 2;
    }
  }
  if (as_uid >= 0 && (setgroups(0, nullptr) != 0 || setgid(as_uid) != 0 || setuid(as_uid) != 0)) {
    std::cerr << "cannot drop privileges to uid " << as_uid << "\n";
    return 4;
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    std::cout << "cannot reach unix:" << socket << std::endl;
    return 3;
  }
  std::unique_ptr<v1::TensorShm::Stub> stub = v1::TensorShm::NewStub(channel);
  Sessions sessions;
  int rc = 2;
  if (mode == "sessions") {
    OpenSessions(*stub, count, sessions);
    rc = 0;
  } else if (mode == "leases") {
    rc = Leases(*stub, name, count, sessions);
  } else if (mode == "waiters") {
    rc = Waiters(*stub, name, count, sessions);
  } else if (mode == "quota") {
    rc = Quota(*stub, name, bytes, sessions);
  } else if (mode == "create") {
    rc = Create(*stub, bytes, count, sessions);
  } else if (mode == "reattach") {
    rc = Reattach(*stub, id, lists, unpublished, sessions);
  } else {
    std::cerr << "unknown mode " << mode << "\n";
  }
  if (hold && rc == 0) {
    std::cout << "holding" << std::endl;
    while (true) pause();  // until killed: the sessions stay open
  }
  return rc;
}
