// tsm_conn_flood: opens many raw connections on a tensorshmd socket, as the accept-admission
// tests' attacker (tests/stress/accept_admission_test.cc, issue 22).
//
//   tsm_conn_flood SOCKET COUNT [--as-uid U] [--open-files N] [--preface] [--wait-closed S]
//                  [--client] [--reconnect] [--reflection K] [--hold]
//
// --open-files N sets RLIMIT_NOFILE (soft and hard) to N before anything else (needs root to go
// past the hard limit); --as-uid U then drops to uid and gid U (needs root). --client first
// connects a tensorshm Client and puts and gets a tensor through it ("client ok"). Then COUNT
// connections are made (blocking connect), each sending the HTTP/2 preface with --preface:
// "connected C failed F". Then it waits up to S seconds (default 5) for the daemon to close
// them: "closed K of C in MS ms" (K: those the daemon had closed when the wait ended; MS: when
// the last of them was seen closed). With --client the Client is used again afterwards ("after
// ok"); with --reconnect the flood's connections are closed and a second Client connects
// (retried for up to 10 s: "reconnect ok"). --reflection K opens K server reflection streams on
// one raw gRPC channel and keeps them open, each asking for the list of services:
// "reflection answered A of K" (A: those that answered; the others were cancelled or refused).
// --hold prints "holding" and waits to be killed.
// Exit 0, 2 for bad usage, 3 if a Client step failed ("error WHAT: STATUS"), 4 if dropping
// privileges failed.
#include <grp.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tensorshm/client.h"

namespace {

constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

int Connect(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Puts a 64 KiB tensor `name` filled with `seed` and gets it back, checking every byte: a
// create, a segment grant over the memory channel, a publish and an acquire.
tensorshm::Status PutAndGet(tensorshm::Client& client, const std::string& name, uint8_t seed) {
  tensorshm::StatusOr<tensorshm::WritableTensor> w = client.Create({{kDLUInt, 8, 1}, {65536}});
  if (!w.ok()) return w.status();
  std::memset(w->data(), seed, 65536);
  if (tensorshm::Status s = client.Publish(*w, name, /*replace=*/true); !s.ok()) return s;
  tensorshm::StatusOr<DLManagedTensorVersioned*> t = client.Acquire(name);
  if (!t.ok()) return t.status();
  const auto* bytes = static_cast<const uint8_t*>((*t)->dl_tensor.data);
  bool same = true;
  for (int i = 0; i < 65536; ++i) same = same && bytes[i] == seed;
  (*t)->deleter(*t);
  if (!same) return tensorshm::Status(tensorshm::StatusCode::kDataLoss, name + ": bytes differ");
  if (tensorshm::StatusOr<tensorshm::ServerStats> stats = client.Stat(); !stats.ok()) {
    return stats.status();
  }
  return tensorshm::Status();
}

// One open reflection stream: started, asked for the list of services, read once.
struct ReflectionStream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call;
  grpc::ByteBuffer reply;
};

// Opens `count` reflection streams on `channel`, keeping them in `streams`; how many answered.
int OpenReflectionStreams(const std::shared_ptr<grpc::Channel>& channel, int count,
                          grpc::CompletionQueue& queue,
                          std::vector<std::unique_ptr<ReflectionStream>>& streams) {
  grpc::GenericStub stub(channel);
  // ServerReflectionRequest{list_services: ""}: field 7, length-delimited, empty.
  const char request_bytes[] = {0x3a, 0x00};
  int answered = 0;
  for (int i = 0; i < count; ++i) {
    auto stream = std::make_unique<ReflectionStream>();
    stream->context.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));
    stream->call = stub.PrepareCall(
        &stream->context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &queue);
    void* tag = nullptr;
    bool ok = false;
    stream->call->StartCall(stream.get());
    bool started = queue.Next(&tag, &ok) && ok;
    grpc::Slice slice(request_bytes, sizeof(request_bytes));
    grpc::ByteBuffer request(&slice, 1);
    if (started) {
      stream->call->Write(request, stream.get());
      started = queue.Next(&tag, &ok) && ok;
    }
    if (started) {
      stream->call->Read(&stream->reply, stream.get());
      if (queue.Next(&tag, &ok) && ok && stream->reply.Length() > 0) ++answered;
    }
    streams.push_back(std::move(stream));
  }
  return answered;
}

int Fail(const std::string& what, const tensorshm::Status& status) {
  std::cout << "error " << what << ": " << status << std::endl;
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  int64_t count = -1;
  if (argc < 3 || !absl::SimpleAtoi(argv[2], &count) || count < 0) {
    std::cerr << "usage: tsm_conn_flood SOCKET COUNT [options] (see the source)\n";
    return 2;
  }
  const std::string socket_path = argv[1];
  int64_t as_uid = -1, open_files = 0, wait_seconds = 5, reflection = 0;
  bool preface = false, with_client = false, reconnect = false, hold = false;
  for (int i = 3; i < argc; ++i) {
    const std::string arg = argv[i];
    bool ok = true;
    if (arg == "--as-uid" && i + 1 < argc) {
      ok = absl::SimpleAtoi(argv[++i], &as_uid);
    } else if (arg == "--open-files" && i + 1 < argc) {
      ok = absl::SimpleAtoi(argv[++i], &open_files);
    } else if (arg == "--wait-closed" && i + 1 < argc) {
      ok = absl::SimpleAtoi(argv[++i], &wait_seconds);
    } else if (arg == "--reflection" && i + 1 < argc) {
      ok = absl::SimpleAtoi(argv[++i], &reflection);
    } else if (arg == "--preface") {
      preface = true;
    } else if (arg == "--client") {
      with_client = true;
    } else if (arg == "--reconnect") {
      reconnect = true;
    } else if (arg == "--hold") {
      hold = true;
    } else {
      ok = false;
    }
    if (!ok) {
      std::cerr << "tsm_conn_flood: bad argument " << arg << "\n";
      return 2;
    }
  }
  if (open_files > 0) {
    const rlimit limit{static_cast<rlim_t>(open_files), static_cast<rlim_t>(open_files)};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      std::cerr << "setrlimit(RLIMIT_NOFILE, " << open_files << "): " << std::strerror(errno)
                << "\n";
      return 4;
    }
  }
  if (as_uid >= 0 && (setgroups(0, nullptr) != 0 || setgid(as_uid) != 0 || setuid(as_uid) != 0)) {
    std::cerr << "cannot drop privileges to uid " << as_uid << "\n";
    return 4;
  }
  const std::string name = "flood-" + std::to_string(getpid());

  std::shared_ptr<tensorshm::Client> client;
  if (with_client) {
    tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> connected =
        tensorshm::Client::Connect(tensorshm::ClientOptions{socket_path, "tsm_conn_flood"});
    if (!connected.ok()) return Fail("connect", connected.status());
    client = *std::move(connected);
    if (tensorshm::Status s = PutAndGet(*client, name, 1); !s.ok()) return Fail("put", s);
    std::cout << "client ok" << std::endl;
  }

  std::vector<pollfd> fds;
  fds.reserve(count);
  int64_t failed = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int fd = Connect(socket_path);
    if (fd < 0) {
      ++failed;
      continue;
    }
    if (preface) (void)send(fd, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    fds.push_back(pollfd{fd, POLLRDHUP, 0});
  }
  std::cout << "connected " << fds.size() << " failed " << failed << std::endl;

  // The daemon closing a connection shows as POLLRDHUP (or POLLHUP); data it sends (gRPC's
  // SETTINGS) does not, as the events asked for are only those.
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::Seconds(wait_seconds);
  absl::Duration last_closed = absl::ZeroDuration();
  std::vector<bool> closed(fds.size(), false);
  int64_t closed_count = 0;
  while (closed_count < static_cast<int64_t>(fds.size()) && absl::Now() < deadline) {
    const int n = poll(fds.data(), fds.size(), 100);
    if (n <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (closed[i] || (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0) continue;
      closed[i] = true;
      fds[i].events = 0;  // reported no more
      ++closed_count;
      last_closed = absl::Now() - start;
    }
  }
  std::cout << "closed " << closed_count << " of " << fds.size() << " in "
            << absl::ToInt64Milliseconds(last_closed) << " ms" << std::endl;

  if (client != nullptr) {
    if (tensorshm::Status s = PutAndGet(*client, name, 2); !s.ok()) return Fail("after", s);
    std::cout << "after ok" << std::endl;
  }
  if (reconnect) {
    for (const pollfd& p : fds) close(p.fd);
    fds.clear();
    tensorshm::Status last;
    const absl::Time until = absl::Now() + absl::Seconds(10);
    bool ok = false;
    while (!ok && absl::Now() < until) {
      tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> again =
          tensorshm::Client::Connect(tensorshm::ClientOptions{socket_path, "tsm_conn_flood-2"});
      if (again.ok()) last = PutAndGet(**again, name + "-2", 3);
      if (!again.ok()) last = again.status();
      ok = last.ok();
      if (!ok) absl::SleepFor(absl::Milliseconds(100));
    }
    if (!ok) return Fail("reconnect", last);
    std::cout << "reconnect ok" << std::endl;
  }
  grpc::CompletionQueue queue;
  std::vector<std::unique_ptr<ReflectionStream>> streams;
  std::shared_ptr<grpc::Channel> channel;
  if (reflection > 0) {
    channel = grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials());
    const int answered =
        OpenReflectionStreams(channel, static_cast<int>(reflection), queue, streams);
    std::cout << "reflection answered " << answered << " of " << reflection << std::endl;
  }
  if (hold) {
    std::cout << "holding" << std::endl;
    pause();
  }
  return 0;
}
