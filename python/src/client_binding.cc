#include "client_binding.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "arrow/import.h"
#include "client/public_status.h"
#include "common/tensor/dtype.h"
#include "common/tensor/name.h"
#include "common/tensor/wire.h"
#include "put.h"
#include "raise_status.h"
#include "storage.h"
#include "tensor_object.h"
#include "waits.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace tensorshm::python {

std::string DescribeClient(const ClientState& state) {
  return absl::StrCat("tensorshm client of session ", state.session_id,
                      " (tensorshmd at unix:", state.socket, ")");
}

ClientRef Live(const ClientState& state) {
  if (state.client == nullptr) {
    SetError("ClosedError",
             DescribeClient(state) + " is closed: connect again with tensorshm.connect()");
    throw nb::python_error();
  }
  return ClientRef(state.client);
}

namespace {

// "cpu", "cpu:0", "cuda" (= "cuda:0") or "cuda:N".
DLDevice ParseDevice(const std::string& device) {
  if (device == "cpu" || device == "cpu:0") return DLDevice{kDLCPU, 0};
  int ordinal = 0;
  if (device == "cuda") return DLDevice{kDLCUDA, 0};
  if (device.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(device.substr(5), &ordinal) &&
      ordinal >= 0) {
    return DLDevice{kDLCUDA, ordinal};
  }
  Raise(absl::InvalidArgumentError(
      absl::StrCat("device = \"", device, "\": expected \"cpu\", \"cuda\" or \"cuda:N\"")));
}

PyTensor Get(PyClient& self, const std::string& name, const std::optional<double>& timeout,
             const std::optional<WaitCanceller>& cancel) {
  const absl::Duration wait = TimeoutFrom(timeout);
  ClientRef client = Live(*self.state);
  tensorshm::StatusOr<DLManagedTensorVersioned*> lease;
  // CUDA tensors: consumers' streams wait for the ready event in __dlpack__.
  if (wait == absl::ZeroDuration()) {
    ReleaseGil release;
    lease = client->Acquire(name, ToChrono(wait), ReadySync::None());
  } else {
    using Result = tensorshm::StatusOr<DLManagedTensorVersioned*>;
    const absl::Time deadline =
        wait == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + wait;
    lease = RunWaiting<Result>(
        *self.state, cancel,
        [&](bool* again) -> std::optional<Result> {
          // The fast path waits in this thread, woken by the publish itself: no thread to wait
          // on, whose wake-up would come on top.
          const absl::Duration left = deadline - absl::Now();
          Result local = client->TryAcquireLocal(
              name, ToChrono(std::clamp(left, absl::ZeroDuration(), kSignalCheck)));
          if (local.status().code() == StatusCode::kUnavailable)
            return std::nullopt;  // the daemon answers
          if (local.status().code() != StatusCode::kNotFound) return local;
          if (absl::Now() < deadline) {
            *again = true;
            return std::nullopt;
          }
          return Result(Status(StatusCode::kDeadlineExceeded,
                               absl::StrCat("name = \"", name, "\": not published within ",
                                            absl::FormatDuration(wait))));
        },
        [&](const WaitCanceller& c) {
          const absl::Duration left = wait == absl::InfiniteDuration()
                                          ? wait
                                          : std::max(absl::ZeroDuration(), deadline - absl::Now());
          return client->Acquire(name, ToChrono(left), ReadySync::None(), c);
        });
  }
  return PyTensor{FromLease(Check(std::move(lease))), name};
}

PyWritableTensor Create(PyClient& self, const std::vector<int64_t>& shape, const std::string& dtype,
                        const std::optional<std::vector<int64_t>>& strides,
                        const std::string& device, bool subbyte_padded,
                        const std::optional<double>& timeout,
                        const std::optional<WaitCanceller>& cancel) {
  const absl::Duration wait = TimeoutFrom(timeout);
  TensorSpec spec;
  spec.dtype = Check(ParseDataType(dtype));
  spec.shape = shape;
  if (strides.has_value()) spec.strides = *strides;
  spec.device = ParseDevice(device);
  spec.subbyte_padded = subbyte_padded;
  ClientRef client = Live(*self.state);
  tensorshm::StatusOr<WritableTensor> tensor;
  if (wait == absl::ZeroDuration()) {
    ReleaseGil release;
    tensor = client->Create(spec, ToChrono(wait));
  } else {
    using Result = tensorshm::StatusOr<WritableTensor>;
    tensor = RunWaiting<Result>(
        *self.state, cancel,
        [&](bool*) -> std::optional<Result> {
          // Memory free now: no wait.
          Result now = client->Create(spec);
          if (now.status().code() == StatusCode::kResourceExhausted) return std::nullopt;
          return now;
        },
        [&](const WaitCanceller& c) { return client->Create(spec, ToChrono(wait), c); });
  }
  PyWritableTensor out;
  out.storage = FromWritable(Check(std::move(tensor)));
  out.client = self.state;
  return out;
}

nb::list SessionDicts(PyClient& self) {
  ClientRef client = Live(*self.state);
  tensorshm::StatusOr<std::vector<SessionInfo>> sessions;
  {
    ReleaseGil release;
    sessions = client->Sessions();
  }
  nb::list out;
  for (const SessionInfo& s : Check(std::move(sessions))) {
    nb::dict d;
    d["session_id"] = s.session_id;  // the daemon's number, as tensorshmctl sessions shows it
    d["pid"] = s.pid;
    d["uid"] = s.uid;
    d["gid"] = s.gid;
    d["client_name"] = s.client_name;
    d["client_version"] = s.client_version;
    d["rpc_leases"] = s.rpc_leases;
    d["page_leases"] = s.page_leases;
    d["unpublished_tensors"] = s.unpublished_tensors;
    d["unpublished_bytes"] = s.unpublished_bytes;
    d["waiting_acquires"] = s.waiting_acquires;
    d["opened_unix_ms"] = s.opened_unix_ms;
    d["own"] = s.own;
    d["redacted"] = s.redacted;
    out.append(d);
  }
  return out;
}

nb::dict StatDict(PyClient& self) {
  ClientRef client = Live(*self.state);
  tensorshm::StatusOr<ServerStats> stats;
  {
    ReleaseGil release;
    stats = client->Stat();
  }
  ServerStats s = Check(std::move(stats));
  nb::dict out;
  out["tensors"] = s.tensors;
  out["leases"] = s.leases;
  out["sessions"] = s.sessions;
  out["names"] = s.names;
  out["evicted_tensors"] = s.evicted_tensors;
  out["evicted_bytes"] = s.evicted_bytes;
  out["creates_waiting"] = s.creates_waiting;
  out["stocked_tensors"] = s.stocked_tensors;
  nb::list pools;
  for (const PoolStats& p : s.pools) {
    nb::dict pool;
    pool["device"] = DeviceName(p.device);
    pool["capacity_bytes"] = p.capacity_bytes;
    pool["used_bytes"] = p.used_bytes;
    pool["stock_bytes"] = p.stock_bytes;
    pool["segments"] = p.segments;
    pool["largest_free_bytes"] = p.largest_free_bytes;
    pools.append(pool);
  }
  out["pools"] = pools;
  return out;
}

tensorshm::StatusOr<std::vector<TensorInfo>> List(PyClient& self, const std::string& prefix) {
  ClientRef client = Live(*self.state);
  ReleaseGil release;
  return client->List(prefix);
}

nb::list ListDicts(PyClient& self, const std::string& prefix) {
  tensorshm::StatusOr<std::vector<TensorInfo>> listed = List(self, prefix);
  nb::list out;
  for (const TensorInfo& info : Check(std::move(listed))) {
    nb::dict d;
    d["name"] = info.name;
    d["shape"] = nb::tuple(nb::cast(info.shape));
    d["dtype"] = DataTypeName(info.dtype);
    d["device"] = DeviceName(info.device);
    d["nbytes"] = info.nbytes;
    d["leases"] = info.leases;
    out.append(d);
  }
  return out;
}

// Names starting with `prefix`, in name order.
std::vector<std::string> Keys(PyClient& self, const std::string& prefix) {
  std::vector<TensorInfo> listed = Check(List(self, prefix));
  std::vector<std::string> names;
  names.reserve(listed.size());
  for (TensorInfo& info : listed) names.push_back(std::move(info.name));
  return names;
}

// Whether `name` is published (taking no lease). False for a name that could not be published.
bool Contains(PyClient& self, const std::string& name) {
  if (!ValidateName(name).ok()) {
    Live(*self.state);  // a closed client still says so
    return false;
  }
  for (const TensorInfo& info : Check(List(self, name))) {
    if (info.name == name) return true;
  }
  return false;
}

// Ends the client: waits in other threads are woken (they raise ClosedError), later calls raise
// ClosedError, and the session closes once the tensors taken from it are released.
void CloseClient(PyClient& self) {
  ClientState& state = *self.state;
  if (state.client == nullptr) return;
  state.session_id = state.client->session_id();
  state.daemon_instance = state.client->daemon_instance();
  std::shared_ptr<Client> client = std::move(state.client);
  ForgetAllocatorClient(client.get());
  for (WaitingCall& call : WaitingCalls()) {
    if (call.client == &state) call.cancel.Cancel();
  }
  ReleaseGil release;
  client.reset();  // the last reference, unless a call in progress holds one: it ends with it
}

// Client::Connect on a thread of its own, while this one looks for signals every
// kSignalCheck: a signal's handler that raises (KeyboardInterrupt) cancels the connect and
// raises here, and interpreter exit (_cancel_waits_at_exit) cancels it too, so neither waits
// for a daemon that does not answer.
tensorshm::StatusOr<std::shared_ptr<Client>> ConnectHearingSignals(const ClientOptions& options) {
  WaitCanceller cancel;
  if (Exiting()) cancel.Cancel();
  std::list<WaitingCall>& calls = WaitingCalls();
  auto it = calls.insert(calls.end(), WaitingCall{nullptr, cancel});
  tensorshm::StatusOr<std::shared_ptr<Client>> result;
  const bool interrupted =
      RunHearingSignals(cancel, result, [&] { return Client::Connect(options, cancel); });
  calls.erase(it);
  if (interrupted) {
    // The exception the signal's handler raised goes up; a client made meanwhile closes.
    if (result.ok()) {
      ReleaseGil release;
      result->reset();
    }
    throw nb::python_error();
  }
  return result;
}

std::string ClientRepr(const PyClient& self) {
  const ClientState& state = *self.state;
  const bool closed = state.client == nullptr;
  return absl::StrCat("tensorshm.Client(socket='", state.socket, "', session_id='",
                      closed ? state.session_id : state.client->session_id(), "', daemon_instance=",
                      closed ? state.daemon_instance : state.client->daemon_instance(),
                      closed ? ", closed" : "", ")");
}

}  // namespace

void DefineClient(nb::module_& m) {
  nb::class_<PyClient> client(m, "_Client");
  DefineArrowImport(client);
  client
      .def_static(
          "connect",
          [](const std::optional<std::string>& socket, const std::optional<std::string>& name,
             double timeout, std::optional<int64_t> server_uid) {
            ClientOptions options;
            if (socket.has_value()) options.socket = *socket;
            if (name.has_value()) options.client_name = *name;
            options.connect_timeout = ToChrono(absl::Seconds(timeout));
            if (server_uid.has_value()) {
              if (*server_uid < 0 || *server_uid >= int64_t{UINT32_MAX}) {
                throw nb::value_error(absl::StrCat("server_uid = ", *server_uid,
                                                   ": must be a uid, 0 to ", UINT32_MAX - 1)
                                          .c_str());
              }
              options.server_uid = static_cast<uint32_t>(*server_uid);
            }
            tensorshm::StatusOr<std::shared_ptr<Client>> client = ConnectHearingSignals(options);
            auto state = std::make_shared<ClientState>();
            state->client = Check(std::move(client));
            state->socket = state->client->socket();
            SetAllocatorClient(state->client);
            return PyClient{std::move(state)};
          },
          "socket"_a = nb::none(), "client_name"_a = nb::none(), "timeout"_a = 5.0,
          "server_uid"_a = nb::none())
      .def("get", &Get, "name"_a, "timeout"_a = 0.0, "cancel"_a = nb::none())
      .def(
          "try_get_local",
          [](PyClient& self, const std::string& name) -> std::optional<PyTensor> {
            ClientRef client = Live(*self.state);
            tensorshm::StatusOr<DLManagedTensorVersioned*> lease = client->TryAcquireLocal(name);
            if (lease.status().code() == StatusCode::kUnavailable ||
                lease.status().code() == StatusCode::kNotFound) {
              return std::nullopt;
            }
            return PyTensor{FromLease(Check(std::move(lease))), name};
          },
          "name"_a,
          "The tensor from this process's fast path, without a call to the daemon or a wait "
          "(the GIL is kept: it takes microseconds); None where only get() can answer.")
      .def("create", &Create, "shape"_a, "dtype"_a, "strides"_a = nb::none(), "device"_a = "cpu",
           "subbyte_padded"_a = false, "timeout"_a = 0.0, "cancel"_a = nb::none())
      .def("put_capsule", &PutCapsule, "name"_a, "capsule"_a, "replace"_a = false,
           "timeout"_a = 0.0, "cancel"_a = nb::none())
      .def("put_exchange", &PutExchange, "name"_a, "obj"_a, "api"_a, "replace"_a = false,
           "timeout"_a = 0.0)
      .def("delete",
           [](PyClient& self, const std::string& name) {
             ClientRef client = Live(*self.state);
             Status status;
             {
               ReleaseGil release;
               status = client->Delete(name);
             }
             Check(status);
           })
      // In the stub, `list` inside _Client names this method, not the builtin: the signatures
      // that return lists say typing.List.
      .def("list", &ListDicts, "prefix"_a = "",
           nb::sig("def list(self, prefix: str = '') -> "
                   "typing.List[typing.Dict[str, typing.Any]]"))
      .def("keys", &Keys, "prefix"_a = "",
           nb::sig("def keys(self, prefix: str = '') -> typing.List[str]"))
      .def("contains", &Contains, "name"_a)
      .def("stat", &StatDict, nb::sig("def stat(self) -> dict[str, typing.Any]"))
      .def("sessions", &SessionDicts,
           nb::sig("def sessions(self) -> typing.List[typing.Dict[str, typing.Any]]"))
      .def("flush",
           [](PyClient& self) {
             ClientRef client = Live(*self.state);
             Status status;
             {
               ReleaseGil release;
               status = client->Flush();
             }
             Check(status);
           })
      .def("close", &CloseClient)
      .def_prop_ro("closed", [](const PyClient& self) { return self.state->client == nullptr; })
      .def_prop_ro("session_id",
                   [](const PyClient& self) {
                     const ClientState& state = *self.state;
                     return state.client == nullptr ? state.session_id : state.client->session_id();
                   })
      .def_prop_ro("daemon_instance",
                   [](const PyClient& self) {
                     const ClientState& state = *self.state;
                     return state.client == nullptr ? state.daemon_instance
                                                    : state.client->daemon_instance();
                   })
      .def_prop_ro("socket", [](const PyClient& self) { return self.state->socket; })
      .def("__repr__", &ClientRepr);
}

}  // namespace tensorshm::python
