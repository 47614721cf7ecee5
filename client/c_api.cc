// The C API over tensorshm::Client. No C++ exception leaves an entry point: each becomes the
// API's error return (RESOURCE_EXHAUSTED for an allocation that failed, INTERNAL for anything
// else) with a message for tsm_last_error.
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/tensor/layout.h"
#include "tensorshm/client.h"
#include "tensorshm/tensorshm.h"

struct tsm_client {
  std::shared_ptr<tensorshm::Client> client;
};

struct tsm_writable {
  tensorshm::WritableTensor tensor;
};

namespace {

thread_local std::string last_error;
// What tsm_last_error returns when the message itself could not be stored (no memory for it).
thread_local const char* last_error_fallback = nullptr;

void SetLastError(absl::string_view message) noexcept {
  try {
    last_error.assign(message.data(), message.size());
    last_error_fallback = nullptr;
  } catch (...) {
    last_error_fallback = "out of memory (the error message could not be stored)";
  }
}

// The library's absl::Status, or the C++ API's tensorshm::Status: same codes, as the C API's.
template <typename AnyStatus>
int Fail(const AnyStatus& status) noexcept {
  SetLastError(status.message());
  return static_cast<int>(status.code());
}

template <typename AnyStatus>
int Check(const AnyStatus& status) noexcept {
  if (status.ok()) {
    last_error.clear();
    last_error_fallback = nullptr;
    return TSM_OK;
  }
  return Fail(status);
}

// A C timeout in ms: TSM_WAIT_FOREVER waits without end.
tensorshm::Duration Timeout(int64_t timeout_ms) {
  // Past what nanoseconds hold (about 292 years): as good as forever, not an overflow.
  constexpr int64_t kLongest =
      std::chrono::duration_cast<std::chrono::milliseconds>(tensorshm::kForever).count();
  if (timeout_ms == TSM_WAIT_FOREVER || timeout_ms >= kLongest) return tensorshm::kForever;
  return std::chrono::milliseconds(timeout_ms);
}

int NullArgument(const char* what) noexcept {
  try {
    return Fail(absl::InvalidArgumentError(std::string(what) + ": must not be NULL"));
  } catch (...) {
    SetLastError("an argument must not be NULL");
    return TSM_INVALID_ARGUMENT;
  }
}

// Runs `body` (which returns a status code) and turns whatever it throws into an error return
// naming `function`.
template <typename Body>
int Guard(const char* function, Body&& body) noexcept {
  const char* what = nullptr;
  int code = TSM_INTERNAL;
  try {
    return body();
  } catch (const std::bad_alloc&) {
    code = TSM_RESOURCE_EXHAUSTED;
    what = "out of memory";
  } catch (const std::length_error& e) {
    code = TSM_RESOURCE_EXHAUSTED;
    what = e.what();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "an unknown C++ exception";
  }
  try {
    SetLastError(std::string(function) + ": " + what);
  } catch (...) {
    SetLastError(what);
  }
  return code;
}

}  // namespace

extern "C" {

const char* tsm_last_error(void) {
  return last_error_fallback != nullptr ? last_error_fallback : last_error.c_str();
}

int tsm_connect(const char* socket, const char* client_name, tsm_client** out) {
  return tsm_connect_server_uid(socket, client_name, -1, out);
}

int tsm_connect_server_uid(const char* socket, const char* client_name, int64_t server_uid,
                           tsm_client** out) {
  if (out == nullptr) return NullArgument("out");
  *out = nullptr;
  return Guard("tsm_connect", [&] {
    // uid_t's largest value is (uid_t)-1, which means "no uid" to the kernel.
    if (server_uid < -1 || server_uid >= int64_t{UINT32_MAX}) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "server_uid = ", server_uid, ": must be -1 (none) or a uid, 0 to ", UINT32_MAX - 1)));
    }
    tensorshm::ClientOptions options;
    if (socket != nullptr) options.socket = socket;
    if (client_name != nullptr) options.client_name = client_name;
    if (server_uid >= 0) options.server_uid = static_cast<uint32_t>(server_uid);
    tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> client =
        tensorshm::Client::Connect(options);
    if (!client.ok()) return Fail(client.status());
    *out = new tsm_client{*std::move(client)};
    return Check(absl::OkStatus());
  });
}

void tsm_client_free(tsm_client* client) { delete client; }

int tsm_create(tsm_client* client, DLDataType dtype, int32_t ndim, const int64_t* shape,
               const int64_t* strides, DLDevice device, tsm_writable** out) {
  return tsm_create_wait(client, dtype, ndim, shape, strides, device, 0, out);
}

int tsm_create_wait(tsm_client* client, DLDataType dtype, int32_t ndim, const int64_t* shape,
                    const int64_t* strides, DLDevice device, int64_t timeout_ms,
                    tsm_writable** out) {
  if (out == nullptr) return NullArgument("out");
  *out = nullptr;
  if (client == nullptr) return NullArgument("client");
  return Guard("tsm_create", [&] {
    if (timeout_ms < 0 && timeout_ms != TSM_WAIT_FOREVER) {
      return Fail(absl::InvalidArgumentError("timeout_ms = " + std::to_string(timeout_ms) +
                                             ": must be >= 0 or TSM_WAIT_FOREVER"));
    }
    // Checked before shape and strides are read: a huge ndim must not copy past their ends.
    if (ndim < 0 || ndim > tensorshm::kMaxDims) {
      return Fail(absl::InvalidArgumentError("ndim = " + std::to_string(ndim) + ": must be 0.." +
                                             std::to_string(tensorshm::kMaxDims)));
    }
    if (ndim > 0 && shape == nullptr) return NullArgument("shape");
    tensorshm::TensorSpec spec;
    spec.dtype = dtype;
    spec.device = device;
    if (ndim > 0) spec.shape.assign(shape, shape + ndim);
    if (ndim > 0 && strides != nullptr) spec.strides.assign(strides, strides + ndim);
    const tensorshm::Duration timeout = Timeout(timeout_ms);
    tensorshm::StatusOr<tensorshm::WritableTensor> tensor = client->client->Create(spec, timeout);
    if (!tensor.ok()) return Fail(tensor.status());
    *out = new tsm_writable{*std::move(tensor)};
    return Check(absl::OkStatus());
  });
}

const DLTensor* tsm_writable_dltensor(const tsm_writable* tensor) {
  return tensor == nullptr ? nullptr : &tensor->tensor.dl_tensor();
}

void* tsm_writable_data(const tsm_writable* tensor) {
  return tensor == nullptr ? nullptr : tensor->tensor.data();
}

int tsm_publish(tsm_client* client, tsm_writable* tensor, const char* name, int replace) {
  if (client == nullptr) return NullArgument("client");
  if (tensor == nullptr) return NullArgument("tensor");
  if (name == nullptr) return NullArgument("name");
  return Guard("tsm_publish",
               [&] { return Check(client->client->Publish(tensor->tensor, name, replace != 0)); });
}

void tsm_writable_free(tsm_writable* tensor) { delete tensor; }

int tsm_acquire(tsm_client* client, const char* name, int64_t timeout_ms,
                DLManagedTensorVersioned** out) {
  if (out == nullptr) return NullArgument("out");
  *out = nullptr;
  if (client == nullptr) return NullArgument("client");
  if (name == nullptr) return NullArgument("name");
  return Guard("tsm_acquire", [&] {
    if (timeout_ms < 0 && timeout_ms != TSM_WAIT_FOREVER) {
      return Fail(absl::InvalidArgumentError("timeout_ms = " + std::to_string(timeout_ms) +
                                             ": must be >= 0 or TSM_WAIT_FOREVER"));
    }
    const tensorshm::Duration timeout = Timeout(timeout_ms);
    tensorshm::StatusOr<DLManagedTensorVersioned*> tensor = client->client->Acquire(name, timeout);
    if (!tensor.ok()) return Fail(tensor.status());
    *out = *tensor;
    return Check(absl::OkStatus());
  });
}

int tsm_delete(tsm_client* client, const char* name) {
  if (client == nullptr) return NullArgument("client");
  if (name == nullptr) return NullArgument("name");
  return Guard("tsm_delete", [&] { return Check(client->client->Delete(name)); });
}

int tsm_stat(tsm_client* client, tsm_stats* out) {
  if (client == nullptr) return NullArgument("client");
  if (out == nullptr) return NullArgument("out");
  return Guard("tsm_stat", [&] {
    tensorshm::StatusOr<tensorshm::ServerStats> stats = client->client->Stat();
    if (!stats.ok()) return Fail(stats.status());
    *out =
        tsm_stats{stats->tensors, stats->leases, stats->sessions, 0, 0, stats->stocked_tensors, 0};
    for (const tensorshm::PoolStats& pool : stats->pools) {
      if (pool.device.device_type == kDLCPU) {
        out->host_capacity_bytes = pool.capacity_bytes;
        out->host_used_bytes = pool.used_bytes;
        out->host_stock_bytes = pool.stock_bytes;
      }
    }
    return Check(absl::OkStatus());
  });
}

int tsm_flush(tsm_client* client) {
  if (client == nullptr) return NullArgument("client");
  return Guard("tsm_flush", [&] { return Check(client->client->Flush()); });
}

}  // extern "C"
