#include "tensorshm/client.h"

#include <grpcpp/client_context.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/admin.h"
#include "client/calls.h"
#include "client/cancel.h"
#include "client/client_access.h"
#include "client/client_core.h"
#include "client/daemon_connection.h"
#include "client/fork.h"
#include "client/interop.h"
#include "client/public_status.h"
#include "common/base/socket_path.h"
#include "common/tensor/grpc_status.h"
#include "common/tensor/name.h"
#include "common/tensor/wire.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

// The Client's session (connect, close) and its calls that only ask the daemon (Delete, List,
// Stat, Sessions). Creates, publishes and acquires are in create.cc, publish.cc and acquire.cc.
namespace tensorshm {
namespace {

// Connect: the pause between attempts while the daemon's socket does not accept yet.
constexpr absl::Duration kConnectRetry = absl::Milliseconds(20);

// Connect; `cancel` (may be null) ends the wait for the daemon.
absl::StatusOr<std::shared_ptr<Client>> ConnectClient(const ClientOptions& given,
                                                      CancelState* cancel) {
  PrepareProcessForClients();
  absl::StatusOr<std::optional<uint32_t>> server_uid = ServerUidOrEnvironment(given.server_uid);
  if (!server_uid.ok()) return server_uid.status();
  ClientOptions options = given;
  options.server_uid = *server_uid;
  const std::string socket = options.socket.empty() ? ClientSocketPath() : options.socket;
  RememberDaemonSocket(socket);
  // Where the path came from, for messages.
  const std::string from = options.socket.empty()
                               ? absl::StrCat("the default path, ", ClientSocketSource())
                               : std::string("the path this program gave");
  // The daemon may be starting (its socket is there but does not accept yet): connecting is
  // tried until connect_timeout, and so is opening the session. No socket file at all is no
  // daemon: said at once. A server of the wrong uid is refused at once.
  const absl::Time deadline = absl::Now() + ToAbsl(options.connect_timeout);
  absl::StatusOr<std::shared_ptr<DaemonConnection>> connection;
  while (true) {
    if (cancel != nullptr && cancel->cancelled()) {
      return absl::CancelledError(
          absl::StrCat("connect to tensorshmd at unix:", socket, ": the wait was cancelled"));
    }
    connection = DaemonConnection::Connect(socket, options.server_uid);
    if (!absl::IsUnavailable(connection.status())) break;
    struct stat file {};
    if (::stat(socket.c_str(), &file) != 0 && (errno == ENOENT || errno == ENOTDIR)) {
      return absl::UnavailableError(absl::StrCat(
          "tensorshmd is not reachable at unix:", socket, ": no socket file at that path (", from,
          "). No daemon serves it: start one with `tensorshmd` (it serves that path by default; "
          "--socket PATH for another, with $TENSORSHM_SOCKET=PATH for clients), or from Python "
          "with `tensorshm.Daemon()`, a private daemon for this program"));
    }
    if (absl::Now() >= deadline) break;
    absl::SleepFor(std::min(kConnectRetry, deadline - absl::Now()));
  }
  if (absl::IsUnavailable(connection.status())) {
    return absl::UnavailableError(absl::StrCat("tensorshmd is not reachable at unix:", socket,
                                               " (is it running? ", from,
                                               "): ", connection.status().message()));
  }
  if (!connection.ok()) return connection.status();
  std::string name = options.client_name;
  if (name.empty()) name = absl::StrCat("pid-", getpid());
  auto core = std::make_shared<ClientCore>(socket, options.server_uid, *std::move(connection),
                                           std::move(name), ToAbsl(options.connect_timeout));
  if (absl::Status s = core->OpenSession(deadline, cancel); !s.ok()) return s;
  core->StartSender(core);
  return ClientAccess::Make(std::move(core));
}

}  // namespace

StatusOr<std::shared_ptr<Client>> Client::Connect(const ClientOptions& options) {
  return ToPublic(ConnectClient(options, nullptr));
}

StatusOr<std::shared_ptr<Client>> Client::Connect(const ClientOptions& options,
                                                  const WaitCanceller& cancel) {
  return ToPublic(ConnectClient(options, ClientAccess::State(cancel)));
}

Client::Client(std::shared_ptr<ClientCore> core) : core_(std::move(core)) {}

Client::~Client() {
  if (core_->forked()) {
    // The parent's: its sender thread does not exist here, and its connection must stay open.
    KeepForever(std::move(core_));
    return;
  }
  core_->StopSender();
}

std::string Client::session_id() const { return absl::StrCat(core_->session_number()); }

uint64_t Client::daemon_instance() const { return core_->daemon_instance(); }

const std::string& Client::socket() const { return core_->socket(); }

namespace {

absl::Status FlushSession(ClientCore& core) {
  if (absl::Status s = core.CheckProcess(); !s.ok()) return s;
  return core.Flush();
}

absl::Status DeleteName(ClientCore& core, std::string_view name) {
  if (absl::Status s = core.CheckProcess(); !s.ok()) return s;
  if (absl::Status s = ValidateName(View(name)); !s.ok()) return s;
  v1::ChannelRequest call;
  v1::DeleteRequest& request = *call.mutable_delete_();
  request.set_name(std::string(name));
  v1::DeleteResponse response;
  return core.CallAcrossRestart(
      absl::StrCat("delete of name = \"", View(name), "\""),
      ClientCore::RestartDeadline(kCallTimeout), /*repeatable=*/true, nullptr, [&] {
        return ChannelOrRpc(core, call, &v1::ChannelResponse::mutable_deleted,
                            &v1::TensorShm::Stub::Delete, request, &response);
      });
}

absl::StatusOr<std::vector<TensorInfo>> ListNames(ClientCore& core, std::string_view prefix) {
  if (absl::Status s = core.CheckProcess(); !s.ok()) return s;
  if (absl::Status s = ValidateNamePrefix(View(prefix)); !s.ok()) return s;
  v1::ListRequest request;
  request.set_prefix(std::string(prefix));
  v1::ListResponse response;
  if (absl::Status s = core.CallAcrossRestart(
          "list", ClientCore::RestartDeadline(kCallTimeout), /*repeatable=*/true, nullptr,
          [&] {
            grpc::ClientContext context;
            core.PrepareContext(context, kCallTimeout);
            return FromGrpcStatus(core.stub()->List(&context, request, &response));
          });
      !s.ok()) {
    return s;
  }
  std::vector<TensorInfo> result;
  for (const v1::TensorInfo& info : response.tensors()) {
    TensorInfo& out = result.emplace_back();
    out.name = info.name();
    out.tensor_id = info.tensor_id();
    out.dtype = DLDataType{static_cast<uint8_t>(info.desc().dtype().code()),
                           static_cast<uint8_t>(info.desc().dtype().bits()),
                           static_cast<uint16_t>(info.desc().dtype().lanes())};
    out.device = FromWire(info.desc().device());
    out.shape.assign(info.desc().shape().begin(), info.desc().shape().end());
    out.strides.assign(info.desc().strides().begin(), info.desc().strides().end());
    out.nbytes = info.desc().nbytes();
    out.leases = info.leases();
    out.byte_offset = info.desc().byte_offset();
    out.dlpack_flags = info.desc().flags();
    out.published_unix_ms = info.published_unix_ms();
    out.publisher_uid = info.publisher_uid();
    out.publisher_pid = info.publisher_pid();
  }
  return result;
}

absl::StatusOr<ServerStats> StatOf(ClientCore& core) {
  if (absl::Status s = core.CheckProcess(); !s.ok()) return s;
  v1::StatResponse response;
  if (absl::Status s = core.CallAcrossRestart(
          "stat", ClientCore::RestartDeadline(kCallTimeout), /*repeatable=*/true, nullptr,
          [&] {
            grpc::ClientContext context;
            core.PrepareContext(context, kCallTimeout);
            return FromGrpcStatus(core.stub()->Stat(&context, v1::StatRequest(), &response));
          });
      !s.ok()) {
    return s;
  }
  ServerStats stats;
  stats.tensors = response.tensors();
  stats.leases = response.leases();
  stats.sessions = response.sessions();
  stats.names = response.names();
  stats.evicted_tensors = response.evicted_tensors();
  stats.evicted_bytes = response.evicted_bytes();
  stats.creates_waiting = response.creates_waiting();
  stats.stocked_tensors = response.stocked_tensors();
  for (const v1::PoolStats& pool : response.pools()) {
    stats.pools.push_back(PoolStats{FromWire(pool.device()), pool.capacity_bytes(),
                                    pool.used_bytes(), pool.segments(), pool.stock_bytes(),
                                    pool.largest_free_bytes()});
  }
  return stats;
}

absl::StatusOr<std::vector<SessionInfo>> SessionsOf(ClientCore& core) {
  if (absl::Status s = core.CheckProcess(); !s.ok()) return s;
  v1::SessionsResponse response;
  if (absl::Status s = core.CallAcrossRestart("sessions", ClientCore::RestartDeadline(kCallTimeout),
                                              /*repeatable=*/true, nullptr,
                                              [&] {
                                                grpc::ClientContext context;
                                                core.PrepareContext(context, kCallTimeout);
                                                return FromGrpcStatus(core.stub()->Sessions(
                                                    &context, v1::SessionsRequest(), &response));
                                              });
      !s.ok()) {
    return s;
  }
  std::vector<SessionInfo> result;
  for (const v1::SessionInfo& info : response.sessions()) {
    SessionInfo& out = result.emplace_back();
    out.session_id = info.session_id();
    out.pid = info.pid();
    out.uid = info.uid();
    out.gid = info.gid();
    out.client_name = info.client_name();
    out.client_version = info.client_version();
    out.rpc_leases = info.rpc_leases();
    out.page_leases = info.page_leases();
    out.unpublished_tensors = info.unpublished_tensors();
    out.unpublished_bytes = info.unpublished_bytes();
    out.waiting_acquires = info.waiting_acquires();
    out.opened_unix_ms = info.opened_unix_ms();
    out.own = info.own();
    out.redacted = info.redacted();
  }
  return result;
}

}  // namespace

Status Client::Flush() { return ToPublic(FlushSession(*core_)); }

Status Client::Delete(std::string_view name) { return ToPublic(DeleteName(*core_, name)); }

StatusOr<std::vector<TensorInfo>> Client::List(std::string_view prefix) {
  return ToPublic(ListNames(*core_, prefix));
}

StatusOr<ServerStats> Client::Stat() { return ToPublic(StatOf(*core_)); }

StatusOr<std::vector<SessionInfo>> Client::Sessions() { return ToPublic(SessionsOf(*core_)); }

absl::Status CopyOnDevice(Client& client, int ordinal, void* dst, const void* src, size_t bytes,
                          CudaStream stream) {
  ClientCore& core = *ClientAccess::Core(client);
  if (absl::Status s = core.CheckProcess(); !s.ok()) return s;
  return core.cuda().CopyDeviceToDevice(ordinal, reinterpret_cast<CUdeviceptr>(dst),
                                        reinterpret_cast<CUdeviceptr>(src), bytes,
                                        static_cast<CUstream>(stream));
}

absl::Status StreamWaitEvent(Client& client, int ordinal, CudaStream stream, void* event) {
  ClientCore& core = *ClientAccess::Core(client);
  if (absl::Status s = core.CheckProcess(); !s.ok()) return s;
  return core.cuda().StreamWaitEvent(ordinal, static_cast<CUstream>(stream),
                                     static_cast<CUevent>(event));
}

}  // namespace tensorshm
