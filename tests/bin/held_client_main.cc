// tsm_held_client: the attacks of the "held" list (issue 22), each made by a process that
// tests/stress/held_test.cc runs as another uid with setpriv (65534, admitted with --allow-uid; or
// 12345, a stranger). It speaks the wire protocol itself (gRPC stub, raw memory channel) and
// prints one line per attempt: "<what>: code N <message>" for a daemon's answer, "<what>: ok" or
// "<what>: <errno name>" for a system call. Modes:
//
//   tsm_held_client descriptors SOCKET NAME [--peer-pids P1,P2]
//       own session and channel; acquires NAME (a tensor of another uid), asks its segment
//       writable ("segment rw"), then read-only ("segment ro"), and tries to make that descriptor
//       writable: mmap PROT_WRITE MAP_SHARED, mprotect of a read-only map, /proc/self/fd reopen
//       O_RDWR, ftruncate, fallocate, pwrite ("segment <attempt>: ..."). The same for the catalog
//       index and records ("index ...", "records ..."); for its own lease page: its seals and the
//       same attempts ("lease ..."). Then, for each pid P: "proc P: <errno>" for opening
//       /proc/P/fd (where another process's lease page descriptor would be)
//   tsm_held_client bind SOCKET TOKEN
//       binds a memory channel with TOKEN (another process's session): "bind: code N ..."; then
//       asks for a lease page and a segment on that connection
//   tsm_held_client tamper SOCKET NAME UNPUBLISHED_ID LEASE_ID
//       through a session of its own, against NAME (bound by another uid), UNPUBLISHED_ID (that
//       uid's unpublished tensor) and LEASE_ID (that uid's lease): delete, publish with replace,
//       publish the other's tensor, abandon it, release the lease; by RPC and on its own channel
//   tsm_held_client stranger SOCKET TOKEN NAME
//       every TensorShm RPC, without a session and with TOKEN (an admitted process's), the
//       Session stream, and the memory channel (bind with TOKEN, then segment and fast path)
//   tsm_held_client malformed SOCKET
//       malformed shapes, strides, dtypes, devices and channel frames, each "<case>: code N ..."
//   tsm_held_client scribble SOCKET --ops N --seed S [--sessions K]
//       K sessions, each with its lease page mapped; N random operations (create, publish,
//       replace, acquire, release, abandon, delete, list, stat, channel create/publish/delete,
//       session restart) mixed with random stores into the lease pages; prints "code NAME count"
//       per answer code (channel answers as "channel-N"), an "unexpected ..." line for each answer
//       that says the daemon failed, then "done N"
//   tsm_held_client waiters SOCKET NAME --count N --threads T
//       T threads (a connection each) start N acquires of NAME waiting up to 300 s between them;
//       then probes with a 20 ms wait until RESOURCE_EXHAUSTED says all N are registered (run
//       with --uid-waiters N; a call refused because a probe took its place is started again),
//       prints "waiting N answered A restarted R" and holds until killed
//   tsm_held_client plant-socket PATH
//       binds a Unix socket at PATH and leaves it there: "planted PATH"
//
// Exit 0, 2 for bad usage, 3 if the daemon cannot be reached.
#include <fcntl.h>
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/shm/channel_frame.h"
#include "common/shm/fast_path_layout.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace {

namespace v1 = tensorshm::v1;
using Stream = grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>;

std::string Code(const grpc::Status& status) {
  return absl::StrCat("code ", static_cast<int>(status.error_code()), " ", status.error_message());
}

std::string Errno(int result) { return result >= 0 ? "ok" : strerrorname_np(errno); }

std::shared_ptr<grpc::Channel> Connect(const std::string& socket, int tag = 0) {
  grpc::ChannelArguments args;
  args.SetInt("tsm_held_connection", tag);  // a connection of its own per tag
  return grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args);
}

// One session on its own stream.
class Session {
 public:
  explicit Session(v1::TensorShm::Stub& stub) : stub_(stub) {
    stream_ = stub_.Session(&context_);
    v1::SessionRequest open;
    open.mutable_open()->set_pid(getpid());
    open.mutable_open()->set_client_name("tsm_held_client");
    v1::SessionResponse opened;
    if (stream_->Write(open) && stream_->Read(&opened) && opened.has_opened()) {
      token_ = opened.opened().session_id();
      return;
    }
    stream_->WritesDone();
    status_ = stream_->Finish();
    if (status_.ok()) status_ = grpc::Status(grpc::StatusCode::UNKNOWN, "stream ended");
    stream_.reset();
  }
  ~Session() {
    if (stream_ == nullptr) return;
    stream_->WritesDone();
    stream_->Finish();
  }
  bool ok() const { return stream_ != nullptr; }
  const grpc::Status& status() const { return status_; }
  const std::string& token() const { return token_; }

  // Sends a release batch; OK, or the first rejection.
  grpc::Status Release(const std::vector<uint64_t>& leases, const std::vector<uint64_t>& abandon) {
    if (stream_ == nullptr) return status_;
    v1::SessionRequest request;
    request.mutable_release()->set_sequence(++sequence_);
    for (uint64_t id : leases) request.mutable_release()->add_lease_ids(id);
    for (uint64_t id : abandon) request.mutable_release()->add_abandoned_tensor_ids(id);
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
  std::string token_;
  uint64_t sequence_ = 0;
};

// Unary calls with a given token ("" sends none).
class Calls {
 public:
  Calls(v1::TensorShm::Stub& stub, std::string token) : stub_(stub), token_(std::move(token)) {}
  void Prepare(grpc::ClientContext* context, std::chrono::milliseconds deadline) const {
    context->set_deadline(std::chrono::system_clock::now() + deadline);
    if (!token_.empty()) context->AddMetadata("tensorshm-session", token_);
  }
  grpc::Status Create(const v1::CreateRequest& request, v1::CreateResponse* response = nullptr) {
    grpc::ClientContext context;
    Prepare(&context, std::chrono::seconds(30));
    v1::CreateResponse unused;
    return stub_.Create(&context, request, response != nullptr ? response : &unused);
  }
  grpc::Status CreateBytes(int64_t bytes, uint64_t* tensor_id = nullptr) {
    v1::CreateRequest request;
    request.mutable_dtype()->set_code(1);  // kDLUInt
    request.mutable_dtype()->set_bits(8);
    request.mutable_dtype()->set_lanes(1);
    request.add_shape(bytes);
    v1::CreateResponse response;
    grpc::Status status = Create(request, &response);
    if (tensor_id != nullptr) *tensor_id = response.tensor_id();
    return status;
  }
  grpc::Status Publish(uint64_t tensor_id, const std::string& name, bool replace) {
    v1::PublishRequest request;
    request.set_tensor_id(tensor_id);
    request.set_name(name);
    request.set_replace(replace);
    v1::PublishResponse response;
    grpc::ClientContext context;
    Prepare(&context, std::chrono::seconds(30));
    return stub_.Publish(&context, request, &response);
  }
  grpc::Status Acquire(const std::string& name, int64_t wait_ms,
                       v1::AcquireResponse* response = nullptr) {
    v1::AcquireRequest request;
    request.set_name(name);
    request.set_wait_ms(wait_ms);
    v1::AcquireResponse unused;
    grpc::ClientContext context;
    Prepare(&context, std::chrono::milliseconds(wait_ms + 30000));
    return stub_.Acquire(&context, request, response != nullptr ? response : &unused);
  }
  grpc::Status Delete(const std::string& name) {
    v1::DeleteRequest request;
    request.set_name(name);
    v1::DeleteResponse response;
    grpc::ClientContext context;
    Prepare(&context, std::chrono::seconds(30));
    return stub_.Delete(&context, request, &response);
  }
  grpc::Status List(const std::string& prefix) {
    v1::ListRequest request;
    request.set_prefix(prefix);
    v1::ListResponse response;
    grpc::ClientContext context;
    Prepare(&context, std::chrono::seconds(30));
    return stub_.List(&context, request, &response);
  }
  grpc::Status Stat() {
    v1::StatRequest request;
    v1::StatResponse response;
    grpc::ClientContext context;
    Prepare(&context, std::chrono::seconds(30));
    return stub_.Stat(&context, request, &response);
  }
  grpc::Status Sessions() {
    v1::SessionsRequest request;
    v1::SessionsResponse response;
    grpc::ClientContext context;
    Prepare(&context, std::chrono::seconds(30));
    return stub_.Sessions(&context, request, &response);
  }

 private:
  v1::TensorShm::Stub& stub_;
  std::string token_;
};

// A raw memory channel connection.
class Channel {
 public:
  explicit Channel(const std::string& socket) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, socket.data(), socket.size());
    if (connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        write(fd_, tensorshm::kChannelHello, tensorshm::kChannelHelloBytes) !=
            static_cast<ssize_t>(tensorshm::kChannelHelloBytes)) {
      close(fd_);
      fd_ = -1;
    }
    timeval timeout{30, 0};
    if (fd_ >= 0) setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  }
  ~Channel() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }

  // The answer's code and message, "code N message", or "closed" if the daemon closed the
  // connection (or never let it open). `*received` gets a descriptor that came with it.
  std::string Call(const v1::ChannelRequest& request, v1::ChannelResponse* response,
                   int* received = nullptr) {
    if (received != nullptr) *received = -1;
    if (fd_ < 0) return "closed";
    return Send(request.SerializeAsString(), response, received);
  }
  std::string Send(const std::string& body, v1::ChannelResponse* response, int* received) {
    std::string frame(tensorshm::kFrameHeaderBytes, '\0');
    tensorshm::EncodeFrameHeader(static_cast<uint32_t>(body.size()), frame.data());
    frame += body;
    std::string answer;
    int fd = -1;
    if (!tensorshm::SendWithFd(fd_, frame, -1, false, "held").ok() ||
        !tensorshm::ReceiveFrame(fd_, &answer, &fd, "held").ok() ||
        !response->ParseFromString(answer)) {
      return "closed";
    }
    if (received != nullptr) {
      *received = fd;
    } else if (fd >= 0) {
      close(fd);
    }
    return absl::StrCat("code ", response->code(), " ", response->message());
  }

 private:
  int fd_ = -1;
};

v1::ChannelRequest Bind(const std::string& token) {
  v1::ChannelRequest request;
  request.mutable_bind()->set_session_id(token);
  return request;
}

v1::ChannelRequest FastPath(v1::FastPathRequest::Part part) {
  v1::ChannelRequest request;
  request.mutable_fast_path()->set_part(part);
  return request;
}

v1::ChannelRequest Segment(uint64_t instance, uint64_t id, bool writable) {
  v1::ChannelRequest request;
  request.mutable_segment()->set_segment_instance(instance);
  request.mutable_segment()->set_segment_id(id);
  request.mutable_segment()->set_writable(writable);
  return request;
}

// Every way to write through read-only descriptor `fd` of `size` bytes, each printed.
void TryToWrite(const std::string& what, int fd, uint64_t size) {
  const size_t length = size > 0 ? size : 4096;
  std::cout << what << " access: " << ((fcntl(fd, F_GETFL) & O_ACCMODE) == O_RDONLY ? "ro" : "rw")
            << std::endl;
  void* rw = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  std::cout << what << " mmap rw: " << (rw == MAP_FAILED ? strerrorname_np(errno) : "ok")
            << std::endl;
  if (rw != MAP_FAILED) munmap(rw, length);
  void* ro = mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, 0);
  if (ro != MAP_FAILED) {
    std::cout << what << " mprotect: " << Errno(mprotect(ro, length, PROT_READ | PROT_WRITE))
              << std::endl;
    munmap(ro, length);
  } else {
    std::cout << what << " mmap ro: " << strerrorname_np(errno) << std::endl;
  }
  const int reopened = open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDWR | O_CLOEXEC);
  std::cout << what << " reopen rw: " << Errno(reopened) << std::endl;
  if (reopened >= 0) close(reopened);
  std::cout << what << " ftruncate shrink: " << Errno(ftruncate(fd, 0)) << std::endl;
  std::cout << what << " ftruncate grow: " << Errno(ftruncate(fd, length * 2)) << std::endl;
  std::cout << what << " fallocate grow: " << Errno(fallocate(fd, 0, length, 4096)) << std::endl;
  std::cout << what << " fallocate punch: "
            << Errno(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096))
            << std::endl;
  const char byte = 0x5a;
  std::cout << what << " pwrite: " << Errno(static_cast<int>(pwrite(fd, &byte, 1, 0))) << std::endl;
  struct stat st;
  if (fstat(fd, &st) == 0) std::cout << what << " size: " << st.st_size << std::endl;
}

int Descriptors(const std::string& socket, const std::string& name, const std::string& pids) {
  std::shared_ptr<grpc::Channel> channel = Connect(socket);
  std::unique_ptr<v1::TensorShm::Stub> stub = v1::TensorShm::NewStub(channel);
  Session session(*stub);
  if (!session.ok()) {
    std::cout << "session: " << Code(session.status()) << std::endl;
    return 3;
  }
  Calls calls(*stub, session.token());
  v1::AcquireResponse acquired;
  grpc::Status status = calls.Acquire(name, 0, &acquired);
  std::cout << "acquire: " << Code(status) << std::endl;
  if (!status.ok()) return 3;
  Channel chan(socket);
  v1::ChannelResponse response;
  std::cout << "bind: " << chan.Call(Bind(session.token()), &response) << std::endl;
  const uint64_t instance = acquired.location().segment_instance();
  const uint64_t segment = acquired.location().segment_id();
  int fd = -1;
  std::cout << "segment rw: " << chan.Call(Segment(instance, segment, true), &response, &fd)
            << std::endl;
  std::cout << "segment rw fd: " << (fd >= 0 ? "received" : "none") << std::endl;
  if (fd >= 0) close(fd);
  std::cout << "segment ro: " << chan.Call(Segment(instance, segment, false), &response, &fd)
            << std::endl;
  if (fd >= 0) {
    TryToWrite("segment", fd, response.segment().size());
    close(fd);
  }
  for (auto [part, what] : {std::pair{v1::FastPathRequest::INDEX, "index"},
                            std::pair{v1::FastPathRequest::RECORDS, "records"}}) {
    std::cout << what << ": " << chan.Call(FastPath(part), &response, &fd) << std::endl;
    if (fd < 0) continue;
    TryToWrite(what, fd, response.fast_path().size());
    close(fd);
  }
  std::cout << "lease: " << chan.Call(FastPath(v1::FastPathRequest::LEASE_PAGE), &response, &fd)
            << std::endl;
  if (fd >= 0) {
    const int seals = fcntl(fd, F_GET_SEALS);
    std::cout << "lease seals:" << ((seals & F_SEAL_SHRINK) ? " shrink" : "")
              << ((seals & F_SEAL_GROW) ? " grow" : "") << ((seals & F_SEAL_SEAL) ? " seal" : "")
              << std::endl;
    std::cout << "lease add seal: " << Errno(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE)) << std::endl;
    TryToWrite("lease", fd, response.fast_path().size());
    close(fd);
  }
  for (absl::string_view pid : absl::StrSplit(pids, ',', absl::SkipEmpty())) {
    const std::string dir = absl::StrCat("/proc/", pid, "/fd");
    const int opened = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    std::cout << "proc " << pid << ": " << Errno(opened) << std::endl;
    if (opened >= 0) close(opened);
    // A lease page's descriptor is numbered low in its process: try the first ones by name too.
    int reached = 0;
    for (int n = 0; n < 64; ++n) {
      const int page = open(absl::StrCat(dir, "/", n).c_str(), O_RDWR | O_CLOEXEC);
      if (page >= 0) {
        ++reached;
        close(page);
      }
    }
    std::cout << "proc " << pid << " fds opened: " << reached << std::endl;
  }
  std::cout << "done" << std::endl;
  return 0;
}

int BindWith(const std::string& socket, const std::string& token) {
  Channel chan(socket);
  v1::ChannelResponse response;
  int fd = -1;
  std::cout << "bind: " << chan.Call(Bind(token), &response) << std::endl;
  std::cout << "lease: " << chan.Call(FastPath(v1::FastPathRequest::LEASE_PAGE), &response, &fd)
            << std::endl;
  std::cout << "lease fd: " << (fd >= 0 ? "received" : "none") << std::endl;
  if (fd >= 0) close(fd);
  std::cout << "segment: " << chan.Call(Segment(0, 1, false), &response, &fd) << std::endl;
  std::cout << "segment fd: " << (fd >= 0 ? "received" : "none") << std::endl;
  if (fd >= 0) close(fd);
  std::cout << "done" << std::endl;
  return 0;
}

v1::CreateRequest Bytes(int64_t bytes) {
  v1::CreateRequest request;
  request.mutable_dtype()->set_code(1);
  request.mutable_dtype()->set_bits(8);
  request.mutable_dtype()->set_lanes(1);
  request.add_shape(bytes);
  return request;
}

int Tamper(const std::string& socket, const std::string& name, uint64_t theirs, uint64_t lease) {
  std::shared_ptr<grpc::Channel> channel = Connect(socket);
  std::unique_ptr<v1::TensorShm::Stub> stub = v1::TensorShm::NewStub(channel);
  Session session(*stub);
  if (!session.ok()) {
    std::cout << "session: " << Code(session.status()) << std::endl;
    return 3;
  }
  Calls calls(*stub, session.token());
  std::cout << "delete: " << Code(calls.Delete(name)) << std::endl;
  uint64_t mine = 0;
  std::cout << "create: " << Code(calls.CreateBytes(64, &mine)) << std::endl;
  std::cout << "replace: " << Code(calls.Publish(mine, name, true)) << std::endl;
  std::cout << "publish theirs: " << Code(calls.Publish(theirs, name + "-stolen", false))
            << std::endl;
  std::cout << "publish theirs replace: " << Code(calls.Publish(theirs, name, true)) << std::endl;
  std::cout << "abandon theirs: " << Code(session.Release({}, {theirs})) << std::endl;
  std::cout << "release their lease: " << Code(session.Release({lease}, {})) << std::endl;
  // The same through its own memory channel.
  Channel chan(socket);
  v1::ChannelResponse response;
  std::cout << "channel bind: " << chan.Call(Bind(session.token()), &response) << std::endl;
  v1::ChannelRequest request;
  request.mutable_delete_()->set_name(name);
  std::cout << "channel delete: " << chan.Call(request, &response) << std::endl;
  request.Clear();
  request.mutable_publish()->set_tensor_id(theirs);
  request.mutable_publish()->set_name(name);
  request.mutable_publish()->set_replace(true);
  std::cout << "channel publish theirs: " << chan.Call(request, &response) << std::endl;
  uint64_t second = 0;
  if (calls.CreateBytes(64, &second).ok()) {
    request.mutable_publish()->set_tensor_id(second);
    std::cout << "channel replace: " << chan.Call(request, &response) << std::endl;
  }
  std::cout << "done" << std::endl;
  return 0;
}

int Stranger(const std::string& socket, const std::string& token, const std::string& name) {
  std::shared_ptr<grpc::Channel> channel = Connect(socket);
  std::unique_ptr<v1::TensorShm::Stub> stub = v1::TensorShm::NewStub(channel);
  for (const std::string& with : {std::string(""), token}) {
    const std::string tag = with.empty() ? "bare" : "token";
    Calls calls(*stub, with);
    std::cout << tag << " Create: " << Code(calls.CreateBytes(64)) << std::endl;
    std::cout << tag << " Publish: " << Code(calls.Publish(1, name + "-x", true)) << std::endl;
    std::cout << tag << " Acquire: " << Code(calls.Acquire(name, 0)) << std::endl;
    std::cout << tag << " Delete: " << Code(calls.Delete(name)) << std::endl;
    std::cout << tag << " List: " << Code(calls.List("")) << std::endl;
    std::cout << tag << " Stat: " << Code(calls.Stat()) << std::endl;
    std::cout << tag << " Sessions: " << Code(calls.Sessions()) << std::endl;
  }
  {
    Session session(*stub);
    std::cout << "Session: " << (session.ok() ? std::string("opened") : Code(session.status()))
              << std::endl;
  }
  Channel chan(socket);
  v1::ChannelResponse response;
  int fd = -1;
  std::cout << "channel bind: " << chan.Call(Bind(token), &response) << std::endl;
  std::cout << "channel lease: "
            << chan.Call(FastPath(v1::FastPathRequest::LEASE_PAGE), &response, &fd) << std::endl;
  if (fd >= 0) std::cout << "channel fd received" << std::endl;
  std::cout << "channel segment: " << chan.Call(Segment(0, 1, false), &response, &fd) << std::endl;
  if (fd >= 0) std::cout << "channel fd received" << std::endl;
  v1::ChannelRequest create;
  *create.mutable_create() = Bytes(64);
  std::cout << "channel create: " << chan.Call(create, &response) << std::endl;
  std::cout << "done" << std::endl;
  return 0;
}

int Malformed(const std::string& socket) {
  std::shared_ptr<grpc::Channel> channel = Connect(socket);
  std::unique_ptr<v1::TensorShm::Stub> stub = v1::TensorShm::NewStub(channel);
  Session session(*stub);
  if (!session.ok()) {
    std::cout << "session: " << Code(session.status()) << std::endl;
    return 3;
  }
  Calls calls(*stub, session.token());
  auto create = [&](const std::string& label, const v1::CreateRequest& request) {
    std::cout << label << ": " << Code(calls.Create(request)) << std::endl;
  };
  v1::CreateRequest r = Bytes(64);
  r.set_shape(0, -3);
  create("shape", r);
  r = Bytes(64);
  r.add_shape(int64_t{1} << 40);
  r.add_shape(int64_t{1} << 40);
  create("shape overflow", r);
  r = Bytes(64);
  r.add_strides(int64_t{1} << 62);
  create("strides", r);
  r = Bytes(64);
  r.mutable_dtype()->set_code(99);
  create("dtype", r);
  r = Bytes(64);
  r.mutable_dtype()->set_lanes(0);
  create("lanes", r);
  r = Bytes(64);
  r.mutable_device()->set_type(99);
  create("device", r);
  r = Bytes(64);
  r.mutable_device()->set_type(1);  // kDLCPU
  r.mutable_device()->set_id(3);
  create("device id", r);
  Channel chan(socket);
  v1::ChannelResponse response;
  std::cout << "channel bind: " << chan.Call(Bind(session.token()), &response) << std::endl;
  std::cout << "frame garbage: "
            << chan.Send(std::string("\xff\xff\xff\xff\xff\x01garbage", 13), &response, nullptr)
            << std::endl;
  Channel huge(socket);
  char header[tensorshm::kFrameHeaderBytes];
  tensorshm::EncodeFrameHeader(1u << 30, header);
  (void)!write(huge.fd(), header, sizeof(header));
  std::cout << "frame huge: " << huge.Send("", &response, nullptr) << std::endl;
  // Still served: a good create.
  std::cout << "after: " << Code(calls.CreateBytes(64)) << std::endl;
  std::cout << "done" << std::endl;
  return 0;
}

// K sessions with their lease pages mapped, and N random operations.
int Scribble(const std::string& socket, int64_t ops, uint64_t seed, int sessions_count) {
  std::mt19937_64 random(seed);
  auto pick = [&](uint64_t n) { return n == 0 ? 0 : random() % n; };
  struct Client {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::TensorShm::Stub> stub;
    std::unique_ptr<Session> session;
    std::unique_ptr<Channel> chan;
    tensorshm::LeasePage* page = nullptr;
    std::vector<uint64_t> leases, unpublished;
  };
  std::vector<Client> clients(sessions_count);
  std::map<std::string, int64_t> codes;
  uint64_t highest_id = 1;
  auto start = [&](Client& c, int index) {
    if (c.page != nullptr) munmap(c.page, tensorshm::kLeasePageBytes);
    c.page = nullptr;
    c.chan.reset();
    c.session.reset();
    c.leases.clear();
    c.unpublished.clear();
    if (c.channel == nullptr) {
      c.channel = Connect(socket, index + 1);
      c.stub = v1::TensorShm::NewStub(c.channel);
    }
    c.session = std::make_unique<Session>(*c.stub);
    if (!c.session->ok()) return;
    c.chan = std::make_unique<Channel>(socket);
    v1::ChannelResponse response;
    c.chan->Call(Bind(c.session->token()), &response);
    int fd = -1;
    c.chan->Call(FastPath(v1::FastPathRequest::LEASE_PAGE), &response, &fd);
    if (fd < 0) return;
    void* address =
        mmap(nullptr, tensorshm::kLeasePageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (address != MAP_FAILED) c.page = static_cast<tensorshm::LeasePage*>(address);
  };
  for (int i = 0; i < sessions_count; ++i) start(clients[i], i);
  const std::vector<std::string> names = {"s/a", "s/b", "s/c", "s/d", "s/e", "s/f", "owned"};
  auto count = [&](const grpc::Status& status, const char* what) {
    ++codes[absl::StrCat(static_cast<int>(status.error_code()))];
    switch (status.error_code()) {
      case grpc::StatusCode::UNKNOWN:
      case grpc::StatusCode::INTERNAL:
      case grpc::StatusCode::UNAVAILABLE:
      case grpc::StatusCode::DATA_LOSS:
        std::cout << "unexpected " << what << ": " << Code(status) << std::endl;
        break;
      default:
        break;
    }
  };
  for (int64_t op = 0; op < ops; ++op) {
    const int index = static_cast<int>(pick(clients.size()));
    Client& c = clients[index];
    if (c.session == nullptr || !c.session->ok()) {
      start(c, index);
      continue;
    }
    Calls calls(*c.stub, c.session->token());
    const std::string& name = names[pick(names.size())];
    switch (pick(14)) {
      case 0:
      case 1: {  // scribbles: ids of live tensors, ids not handed out yet, anything
        if (c.page == nullptr) break;
        for (int k = 0; k < 8; ++k) {
          const uint64_t slot = pick(tensorshm::kLeaseSlots);
          uint64_t value = 0;
          switch (pick(5)) {
            case 0:
              value = pick(highest_id + 16);
              break;
            case 1:
              value = random();
              break;
            case 2:
              value = ~uint64_t{0};
              break;
            case 3:
              value = 0;
              break;
            default:
              value = highest_id - pick(8);
              break;
          }
          c.page->slots[slot].store(value, std::memory_order_seq_cst);
        }
        ++codes["scribble"];
        break;
      }
      case 2:
      case 3: {
        uint64_t id = 0;
        grpc::Status s = calls.CreateBytes(static_cast<int64_t>(pick(8192)), &id);
        count(s, "create");
        if (s.ok()) {
          c.unpublished.push_back(id);
          highest_id = std::max(highest_id, id);
        }
        break;
      }
      case 4:
      case 5: {
        uint64_t id =
            c.unpublished.empty() || pick(8) == 0 ? pick(highest_id + 4) : c.unpublished.back();
        grpc::Status s = calls.Publish(id, name, pick(2) == 0);
        count(s, "publish");
        if (!c.unpublished.empty() && id == c.unpublished.back()) c.unpublished.pop_back();
        break;
      }
      case 6:
      case 7: {
        v1::AcquireResponse acquired;
        grpc::Status s = calls.Acquire(name, 0, &acquired);
        count(s, "acquire");
        if (s.ok()) c.leases.push_back(acquired.lease_id());
        break;
      }
      case 8: {
        std::vector<uint64_t> leases;
        if (!c.leases.empty()) {
          leases.push_back(c.leases.back());
          c.leases.pop_back();
        }
        if (pick(4) == 0) leases.push_back(pick(1 << 20));
        std::vector<uint64_t> abandon;
        if (pick(2) == 0 && !c.unpublished.empty()) {
          abandon.push_back(c.unpublished.back());
          c.unpublished.pop_back();
        }
        if (pick(4) == 0) abandon.push_back(pick(highest_id + 4));
        count(c.session->Release(leases, abandon), "release");
        break;
      }
      case 9:
        count(pick(3) == 0 ? calls.Delete(name) : calls.List(""), "delete or list");
        break;
      case 10:
        count(calls.Stat(), "stat");
        break;
      case 11: {  // the channel's create / publish / delete
        v1::ChannelRequest request;
        v1::ChannelResponse response;
        switch (pick(3)) {
          case 0:
            *request.mutable_create() = Bytes(static_cast<int64_t>(pick(4096)));
            break;
          case 1:
            request.mutable_publish()->set_tensor_id(pick(highest_id + 4));
            request.mutable_publish()->set_name(name);
            request.mutable_publish()->set_replace(pick(2) == 0);
            break;
          default:
            request.mutable_delete_()->set_name(name);
            break;
        }
        const std::string answer = c.chan->Call(request, &response);
        // UNAVAILABLE is an answer of the channel's create (the pool must grow: the client then
        // uses the RPC), not a sign of a daemon going away.
        ++codes[answer == "closed" ? "channel-closed" : absl::StrCat("channel-", response.code())];
        if (answer == "closed" || response.code() == 2 || response.code() == 13 ||
            response.code() == 15) {
          std::cout << "unexpected channel " << request.kind_case() << ": " << answer << std::endl;
        }
        if (response.has_created())
          highest_id = std::max(highest_id, response.created().tensor_id());
        break;
      }
      case 12:
        if (pick(50) == 0) {
          start(c, index);  // the session ends with its page (and whatever its slots say)
          ++codes["restart"];
        }
        break;
      default: {  // a waiting acquire that times out at once
        count(calls.Acquire(name + "-never", 1), "waiting acquire");
        break;
      }
    }
  }
  for (const auto& [code, n] : codes) std::cout << "code " << code << " " << n << std::endl;
  std::cout << "done " << ops << std::endl;
  return 0;
}

int Waiters(const std::string& socket, const std::string& name, int64_t count, int threads) {
  std::shared_ptr<grpc::Channel> channel = Connect(socket);
  std::unique_ptr<v1::TensorShm::Stub> stub = v1::TensorShm::NewStub(channel);
  Session session(*stub);
  if (!session.ok()) {
    std::cout << "session: " << Code(session.status()) << std::endl;
    return 3;
  }
  struct Pending {
    grpc::ClientContext context;
    v1::AcquireRequest request;
    v1::AcquireResponse response;
  };
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::TensorShm::Stub>> stubs;
  for (int t = 0; t < threads; ++t) {
    channels.push_back(Connect(socket, 100 + t));
    stubs.push_back(v1::TensorShm::NewStub(channels.back()));
  }
  std::mutex mu;
  std::vector<int> refused;  // connections of calls the waiter limit refused, to start again
  std::atomic<int64_t> answered{0};
  // The calls live until the process ends (it is killed while they wait).
  auto start = [&](int t) {
    auto* p = new Pending;
    p->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(330));
    p->context.AddMetadata("tensorshm-session", session.token());
    p->request.set_name(name);
    p->request.set_wait_ms(300000);
    stubs[t]->async()->Acquire(&p->context, &p->request, &p->response, [&, t](grpc::Status status) {
      if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        std::lock_guard<std::mutex> lock(mu);
        refused.push_back(t);
      } else {
        answered.fetch_add(1);
      }
    });
  };
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const int64_t mine = count / threads + (t < count % threads ? 1 : 0);
      for (int64_t i = 0; i < mine; ++i) start(t);
    });
  }
  for (std::thread& worker : workers) worker.join();
  // The daemon registers them in its own time: probe until the uid's waiter limit (--uid-waiters
  // N) refuses one, which means the N calls hold every place. A probe may take a place a call
  // was about to: that call is refused, and started again.
  Calls calls(*stub, session.token());
  bool full = false;
  int64_t restarted = 0;
  for (int attempt = 0; attempt < 6000 && !full; ++attempt) {
    std::vector<int> again;
    {
      std::lock_guard<std::mutex> lock(mu);
      again.swap(refused);
    }
    for (int t : again) start(t);
    restarted += static_cast<int64_t>(again.size());
    grpc::Status probe = calls.Acquire(name + "-probe", 20);
    full = probe.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
    if (!full && probe.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      std::cout << "probe: " << Code(probe) << std::endl;
    }
  }
  std::cout << (full ? "waiting " : "not all waiting ") << count << " answered " << answered.load()
            << " restarted " << restarted << std::endl;
  while (true) pause();  // until killed
}

int PlantSocket(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    std::cout << "bind " << path << ": " << strerrorname_np(errno) << std::endl;
    return 3;
  }
  std::cout << "planted " << path << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A connection the daemon closes is an answer here, not a reason to die.
  std::signal(SIGPIPE, SIG_IGN);
  std::vector<std::string> positional;
  int64_t ops = 1000, count = 0, threads = 1, sessions = 4;
  uint64_t seed = 1;
  std::string pids;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto number = [&](auto* out) {
      if (i + 1 >= argc || !absl::SimpleAtoi(argv[++i], out)) {
        std::cerr << arg << ": expected a number\n";
        std::exit(2);
      }
    };
    if (arg == "--ops") {
      number(&ops);
    } else if (arg == "--seed") {
      number(&seed);
    } else if (arg == "--count") {
      number(&count);
    } else if (arg == "--threads") {
      number(&threads);
    } else if (arg == "--sessions") {
      number(&sessions);
    } else if (arg == "--peer-pids") {
      pids = i + 1 < argc ? argv[++i] : "";
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() < 2) {
    std::cerr << "usage: tsm_held_client MODE SOCKET ... (see the source)\n";
    return 2;
  }
  const std::string& mode = positional[0];
  const std::string& socket = positional[1];
  auto at = [&](size_t i) { return i < positional.size() ? positional[i] : std::string(); };
  auto id_at = [&](size_t i) {
    uint64_t id = 0;
    if (!absl::SimpleAtoi(at(i), &id)) {
      std::cerr << mode << ": argument " << i << " must be a number\n";
      std::exit(2);
    }
    return id;
  };
  if (mode == "descriptors") return Descriptors(socket, at(2), pids);
  if (mode == "bind") return BindWith(socket, at(2));
  if (mode == "tamper") return Tamper(socket, at(2), id_at(3), id_at(4));
  if (mode == "stranger") return Stranger(socket, at(2), at(3));
  if (mode == "malformed") return Malformed(socket);
  if (mode == "scribble") return Scribble(socket, ops, seed, static_cast<int>(sessions));
  if (mode == "waiters") return Waiters(socket, at(2), count, static_cast<int>(threads));
  if (mode == "plant-socket") return PlantSocket(socket);
  std::cerr << "unknown mode " << mode << "\n";
  return 2;
}
