// A client program for the waiter load test (tests/stress/waiter_load_test.cc), one of three roles:
//
//   waiter_load_client waiters SOCKET --first F --count N --wait-ms W
//       Opens a session (a raw Session stream) and sends N Acquire calls at once (gRPC's callback
//       stub) for names F .. F+N-1: even K waits for "pub/K" until the call's deadline (a
//       publisher binds it), odd K for "never/K" with wait_ms W (nobody does). Prints
//       "issued N" once all are sent, then for each answer "got pub/K TENSOR_ID", and at the end
//       "waiters got G expired E wrong X"; every wrong answer is printed ("wrong ...") and makes
//       the exit status 1.
//   waiter_load_client churn SOCKET --sessions S --first F --count N --iterations I --tag T
//       S sessions (C++ Clients, a thread each) loop I times over create / publish with replace
//       / delete of a name of their own ("churn/T/s"); between iterations they publish their
//       share of "pub/K" for even K in F .. F+N-1, each once, printing
//       "published pub/K TENSOR_ID". Prints "churn ok" at the end.
//   waiter_load_client observe SOCKET --name NAME --stop-file PATH
//       Until PATH exists: a Stat, then an Acquire of NAME (published) without waiting, both
//       raw gRPC calls, timed; leases are given back in batches on the session stream. Prints
//       "observer stat n N median_us M p99_us P max_us X max_at_s T" (T: when the slowest call
//       began, in seconds since the observer started), the same for "acquire", and
//       "observer failures F" (exit status 1 if F > 0).
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tensorshm/client.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace {

using tensorshm::v1::TensorShm;

constexpr auto kCallDeadline = std::chrono::minutes(5);
// The observer's calls: a call that takes this long is reported as a failure.
constexpr auto kObserverDeadline = std::chrono::seconds(60);

struct Args {
  std::string role;
  std::string socket;
  int64_t first = 0;
  int64_t count = 0;
  int64_t wait_ms = 0;
  int64_t sessions = 0;
  int64_t iterations = 0;
  std::string tag;
  std::string name;
  std::string stop_file;
};

// A raw Session stream, open for the life of the object.
class RawSession {
 public:
  explicit RawSession(const std::string& socket)
      : channel_(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials())),
        stub_(TensorShm::NewStub(channel_)) {}

  bool Open(const std::string& client_name) {
    stream_ = stub_->Session(&context_);
    tensorshm::v1::SessionRequest open;
    open.mutable_open()->set_pid(getpid());
    open.mutable_open()->set_client_name(client_name);
    tensorshm::v1::SessionResponse opened;
    if (!stream_->Write(open) || !stream_->Read(&opened)) return false;
    token_ = opened.opened().session_id();
    return !token_.empty();
  }

  bool Release(const std::vector<uint64_t>& leases) {
    tensorshm::v1::SessionRequest request;
    request.mutable_release()->mutable_lease_ids()->Assign(leases.begin(), leases.end());
    tensorshm::v1::SessionResponse ack;
    return stream_->Write(request) && stream_->Read(&ack) && ack.ack().rejected_size() == 0;
  }

  void Close() {
    stream_->WritesDone();
    stream_->Finish().ok();
  }

  void Prepare(grpc::ClientContext* context, std::chrono::seconds deadline = kCallDeadline) const {
    context->set_deadline(std::chrono::system_clock::now() + deadline);
    context->AddMetadata("tensorshm-session", token_);
  }

  TensorShm::Stub& stub() { return *stub_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<TensorShm::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<
      grpc::ClientReaderWriter<tensorshm::v1::SessionRequest, tensorshm::v1::SessionResponse>>
      stream_;
  std::string token_;
};

int RunWaiters(const Args& args) {
  RawSession session(args.socket);
  if (!session.Open(absl::StrCat("waiters-", args.first))) {
    std::cout << "wrong: cannot open a session" << std::endl;
    return 1;
  }
  struct Call {
    grpc::ClientContext context;
    tensorshm::v1::AcquireRequest request;
    tensorshm::v1::AcquireResponse response;
    int64_t k = 0;
  };
  std::vector<std::unique_ptr<Call>> calls;
  std::mutex mu;
  std::condition_variable all_done;
  int64_t done = 0, got = 0, expired = 0, wrong = 0;
  const std::string expected_message =
      absl::StrCat("not published within wait_ms = ", args.wait_ms);
  for (int64_t k = args.first; k < args.first + args.count; ++k) {
    auto call = std::make_unique<Call>();
    call->k = k;
    const bool published = k % 2 == 0;
    call->request.set_name(absl::StrCat(published ? "pub/" : "never/", k));
    call->request.set_wait_ms(published ? -1 : args.wait_ms);
    session.Prepare(&call->context);
    calls.push_back(std::move(call));
  }
  for (const std::unique_ptr<Call>& owned : calls) {
    Call* call = owned.get();
    session.stub().async()->Acquire(
        &call->context, &call->request, &call->response, [&, call](grpc::Status status) {
          std::string line;
          const bool published = call->k % 2 == 0;
          std::lock_guard<std::mutex> lock(mu);
          if (published && status.ok() && call->response.tensor_id() != 0) {
            ++got;
            line = absl::StrCat("got pub/", call->k, " ", call->response.tensor_id());
          } else if (!published && status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                     absl::StrContains(status.error_message(), expected_message)) {
            ++expired;
          } else {
            ++wrong;
            line =
                absl::StrCat("wrong ", call->request.name(), ": code ", status.error_code(), " \"",
                             status.error_message(), "\" tensor ", call->response.tensor_id());
          }
          if (!line.empty()) std::cout << line << "\n";
          if (++done == args.count) all_done.notify_all();
        });
  }
  std::cout << "issued " << args.count << std::endl;
  {
    std::unique_lock<std::mutex> lock(mu);
    all_done.wait(lock, [&] { return done == args.count; });
    std::cout << "waiters got " << got << " expired " << expired << " wrong " << wrong << std::endl;
  }
  session.Close();
  return wrong == 0 ? 0 : 1;
}

int RunChurn(const Args& args) {
  std::atomic<int> failures{0};
  std::mutex out;
  std::vector<std::thread> threads;
  for (int64_t s = 0; s < args.sessions; ++s) {
    threads.emplace_back([&, s] {
      auto fail = [&](const std::string& what, const tensorshm::Status& status) {
        std::lock_guard<std::mutex> lock(out);
        std::cout << "churn failed: session " << s << ": " << what << ": " << status << std::endl;
        ++failures;
      };
      tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> client = tensorshm::Client::Connect(
          tensorshm::ClientOptions{args.socket, absl::StrCat("churn-", args.tag, "-", s)});
      if (!client.ok()) return fail("connect", client.status());
      // This session's share of the names waiters wait for: every sessions-th even K.
      std::vector<int64_t> mine;
      for (int64_t k = args.first; k < args.first + args.count; ++k) {
        if (k % 2 == 0 && (k / 2) % args.sessions == s) mine.push_back(k);
      }
      const std::string own = absl::StrCat("churn/", args.tag, "/", s);
      size_t next = 0;
      for (int64_t i = 0; i < args.iterations; ++i) {
        tensorshm::StatusOr<tensorshm::WritableTensor> w =
            (*client)->Create({{kDLUInt, 8, 1}, {4096}});
        if (!w.ok()) return fail("create", w.status());
        static_cast<uint8_t*>(w->data())[0] = static_cast<uint8_t>(i);
        if (tensorshm::Status st = (*client)->Publish(*w, own, /*replace=*/true); !st.ok()) {
          return fail("publish " + own, st);
        }
        if (i % 3 == 2) {
          if (tensorshm::Status st = (*client)->Delete(own); !st.ok())
            return fail("delete " + own, st);
        }
        // Spread this session's waited-for names over its iterations.
        const size_t due = mine.size() * static_cast<size_t>(i + 1) / args.iterations;
        for (; next < due; ++next) {
          const std::string name = absl::StrCat("pub/", mine[next]);
          tensorshm::StatusOr<tensorshm::WritableTensor> t =
              (*client)->Create({{kDLUInt, 8, 1}, {64}});
          if (!t.ok()) return fail("create", t.status());
          const uint64_t id = t->tensor_id();
          if (tensorshm::Status st = (*client)->Publish(*t, name); !st.ok()) {
            return fail("publish " + name, st);
          }
          std::lock_guard<std::mutex> lock(out);
          std::cout << "published " << name << " " << id << "\n";
        }
      }
      if (tensorshm::Status st = (*client)->Flush(); !st.ok()) return fail("flush", st);
    });
  }
  for (std::thread& thread : threads) thread.join();
  if (failures.load() != 0) return 1;
  std::cout << "churn ok" << std::endl;
  return 0;
}

int RunObserver(const Args& args) {
  RawSession session(args.socket);
  if (!session.Open("observer")) {
    std::cout << "observer failures 1 (cannot open a session)" << std::endl;
    return 1;
  }
  // Latencies in microseconds, and when each call began (seconds into the run).
  std::vector<std::pair<int64_t, double>> stat_us, acquire_us;
  const absl::Time began = absl::Now();
  std::vector<uint64_t> leases;
  int64_t failures = 0;
  auto micros = [](absl::Time start) { return absl::ToInt64Microseconds(absl::Now() - start); };
  while (!std::filesystem::exists(args.stop_file)) {
    {
      grpc::ClientContext context;
      session.Prepare(&context, kObserverDeadline);
      tensorshm::v1::StatRequest request;
      tensorshm::v1::StatResponse response;
      const absl::Time start = absl::Now();
      grpc::Status status = session.stub().Stat(&context, request, &response);
      stat_us.emplace_back(micros(start), absl::ToDoubleSeconds(start - began));
      if (!status.ok()) {
        ++failures;
        std::cout << "observer: Stat failed after " << micros(start) << " us: code "
                  << status.error_code() << " " << status.error_message() << std::endl;
      }
    }
    {
      grpc::ClientContext context;
      session.Prepare(&context, kObserverDeadline);
      tensorshm::v1::AcquireRequest request;
      request.set_name(args.name);
      tensorshm::v1::AcquireResponse response;
      const absl::Time start = absl::Now();
      grpc::Status status = session.stub().Acquire(&context, request, &response);
      acquire_us.emplace_back(micros(start), absl::ToDoubleSeconds(start - began));
      if (!status.ok()) {
        ++failures;
        std::cout << "observer: Acquire failed after " << micros(start) << " us: code "
                  << status.error_code() << " " << status.error_message() << std::endl;
      } else {
        leases.push_back(response.lease_id());
      }
    }
    if (leases.size() >= 100) {
      if (!session.Release(leases)) {
        ++failures;
        std::cout << "observer: release failed" << std::endl;
      }
      leases.clear();
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  auto report = [](const char* what, std::vector<std::pair<int64_t, double>>& us) {
    std::sort(us.begin(), us.end());
    if (us.empty()) us.emplace_back(0, 0.0);
    std::cout << "observer " << what << " n " << us.size() << " median_us "
              << us[us.size() / 2].first << " p99_us " << us[us.size() * 99 / 100].first
              << " max_us " << us.back().first << " max_at_s " << us.back().second << std::endl;
  };
  report("stat", stat_us);
  report("acquire", acquire_us);
  std::cout << "observer failures " << failures << std::endl;
  session.Close();
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: waiter_load_client waiters|churn|observe SOCKET [flags]\n";
    return 2;
  }
  Args args;
  args.role = argv[1];
  args.socket = argv[2];
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    bool ok = true;
    if (flag == "--first") {
      ok = absl::SimpleAtoi(value, &args.first);
    } else if (flag == "--count") {
      ok = absl::SimpleAtoi(value, &args.count);
    } else if (flag == "--wait-ms") {
      ok = absl::SimpleAtoi(value, &args.wait_ms);
    } else if (flag == "--sessions") {
      ok = absl::SimpleAtoi(value, &args.sessions);
    } else if (flag == "--iterations") {
      ok = absl::SimpleAtoi(value, &args.iterations);
    } else if (flag == "--tag") {
      args.tag = value;
    } else if (flag == "--name") {
      args.name = value;
    } else if (flag == "--stop-file") {
      args.stop_file = value;
    } else {
      ok = false;
    }
    if (!ok) {
      std::cerr << "waiter_load_client: " << flag << " = \"" << value << "\": not understood\n";
      return 2;
    }
  }
  if (args.role == "waiters") return RunWaiters(args);
  if (args.role == "churn") return RunChurn(args);
  if (args.role == "observe") return RunObserver(args);
  std::cerr << "waiter_load_client: role \"" << args.role << "\": expected waiters, churn or "
            << "observe\n";
  return 2;
}
