// tensorshm C++ client: publish tensors into tensorshmd's shared memory and acquire them
// zero-copy as DLPack tensors.
//
//   auto client = tensorshm::Client::Connect().value();
//   auto w = client->Create({{kDLFloat, 32, 1}, {2, 3}}).value();
//   std::fill_n(static_cast<float*>(w.data()), 6, 1.0f);
//   client->Publish(w, "weights/layer0").IgnoreError();
//   DLManagedTensorVersioned* t = client->Acquire("weights/layer0").value();
//   ...                  // read t->dl_tensor; it is read-only
//   t->deleter(t);       // gives the lease back
#ifndef TENSORSHM_CLIENT_H_
#define TENSORSHM_CLIENT_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorshm/export.h"
#include "tensorshm/status.h"

namespace tensorshm {

struct ClientOptions {
  // Empty: $TENSORSHM_SOCKET; else the user's own daemon's socket ($XDG_RUNTIME_DIR/
  // tensorshm.sock, else /tmp/tensorshm-$UID/tensorshm.sock) when one is there; else the packaged
  // daemon's /run/tensorshm/tensorshm.sock when one is there.
  std::string socket;
  std::string client_name;  // shown in the daemon's logs
  // How long Connect waits for the daemon to answer.
  Duration connect_timeout = std::chrono::seconds(5);
  // Who may serve the socket. The client checks the uid of the process serving every connection
  // it makes (SO_PEERCRED): by default it must be this process's effective uid, root, or the
  // daemon serving /run/tensorshm/tensorshm.sock from a /run/tensorshm that only root could have
  // made for it (that uid's and writable by it alone, every directory above root's alone, as
  // systemd's RuntimeDirectory= makes it), since a daemon of another user reads and
  // can change every tensor passed through it, and another user could have taken over the
  // socket's path. A daemon run as another user elsewhere is accepted when its uid is named here,
  // or, when unset here, in
  // $TENSORSHM_SERVER_UID (a value that is not a uid is INVALID_ARGUMENT). A refused server is
  // PERMISSION_DENIED naming the socket, the server's uid and pid and this option.
  std::optional<uint32_t> server_uid = std::nullopt;
};

struct TensorSpec {
  DLDataType dtype{};
  std::vector<int64_t> shape = {};
  std::vector<int64_t> strides = {};  // in elements; empty: C-contiguous
  DLDevice device = {kDLCPU, 0};
  // Sub-byte dtypes only (float4, int4, ...): store one element per byte, as numpy and ml_dtypes
  // do, instead of packed; tensors then carry DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED.
  bool subbyte_padded = false;
};

struct TensorInfo {
  std::string name;
  uint64_t tensor_id = 0;
  DLDataType dtype{};
  DLDevice device{};
  std::vector<int64_t> shape = {};
  std::vector<int64_t> strides;
  int64_t nbytes = 0;
  int64_t leases = 0;  // every client's leases on it, RPC and fast path together
  uint64_t byte_offset = 0;
  uint64_t dlpack_flags = 0;  // DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED or 0
  // When it was published, by the daemon's clock (Unix epoch, ms); 0 if the daemon does not know.
  int64_t published_unix_ms = 0;
  uint32_t publisher_uid = 0;
  // 0 if the daemon does not know, or does not tell this uid (another uid's tensor).
  int64_t publisher_pid = 0;
};

struct PoolStats {
  DLDevice device{};
  int64_t capacity_bytes = 0;
  int64_t used_bytes = 0;  // what tensors hold, published or not (stock not included)
  int64_t segments = 0;
  // What stocked buffers hold: buffers the daemon made ahead of a producer's need, counted as
  // stock until published (a client takes one to fill without telling the daemon). 0 on CUDA.
  int64_t stock_bytes = 0;
  // The largest tensor the pool could take now (uids' fair shares aside): see
  // PoolStats.largest_free_bytes in tensorshm.proto.
  int64_t largest_free_bytes = 0;
};

struct ServerStats {
  int64_t tensors = 0;  // tensors holding memory (published, unpublished, or unbound but leased)
  int64_t leases = 0;
  int64_t sessions = 0;
  std::vector<PoolStats> pools;
  int64_t names = 0;            // names bound
  int64_t evicted_tensors = 0;  // evicted by --evict lru since the daemon started
  int64_t evicted_bytes = 0;    // their buffers' bytes
  int64_t creates_waiting = 0;  // creates waiting for memory now (Create with a timeout)
  int64_t stocked_tensors = 0;  // of `tensors`, the stocked buffers (see PoolStats::stock_bytes)
};

// One client session of the daemon (Client::Sessions). A session of another uid than the
// caller's comes `redacted` (unless the caller is the daemon's uid or root): pid, gid, client
// name and version are then 0 / empty.
struct SessionInfo {
  uint64_t session_id = 0;
  int64_t pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
  std::string client_name;
  std::string client_version;
  int64_t rpc_leases = 0;   // leases taken over RPC
  int64_t page_leases = 0;  // lease page slots its fast path holds
  int64_t unpublished_tensors = 0;
  int64_t unpublished_bytes = 0;
  int64_t waiting_acquires = 0;
  int64_t opened_unix_ms = 0;  // by the daemon's clock
  bool own = false;            // this Client's own session
  bool redacted = false;
};

// A CUDA stream (CUstream) as this API takes one, so that this header needs no cuda.h.
using CudaStream = void*;
// CUDA's legacy default stream (CU_STREAM_LEGACY).
inline CudaStream const kLegacyDefaultStream = reinterpret_cast<CudaStream>(0x1);

// How an acquire of a CUDA tensor orders the caller after its producer's writes (the ready event
// the producer recorded at publish). Host tensors, and tensors without an event, ignore it.
struct ReadySync {
  enum class Mode {
    kHost,    // the calling thread waits (cuEventSynchronize) before Acquire returns
    kStream,  // `stream` waits (cuStreamWaitEvent); Acquire returns at once
    kNone,    // nobody waits now: call WaitReady before using the tensor
  };
  Mode mode = Mode::kHost;
  CudaStream stream = nullptr;

  static ReadySync Host() { return {}; }
  static ReadySync Stream(CudaStream stream) { return {Mode::kStream, stream}; }
  static ReadySync None() { return {Mode::kNone, nullptr}; }
};

// For a tensor acquired with ReadySync::None(): waits for its ready event as `sync` says.
// OK at once for host tensors, tensors without an event, and Mode::kNone. INVALID_ARGUMENT for a
// tensor that did not come from a tensorshm Client.
TENSORSHM_EXPORT Status WaitReady(const DLManagedTensorVersioned* tensor, ReadySync sync);

// Whether an acquired tensor's lease still holds: OK while the daemon keeps the tensor's memory
// for it. DATA_LOSS once the daemon restarted and did not take the lease back (a clean restart,
// or a recovery whose grace period ended before this client reconnected): the tensor stays
// mapped and readable, but its bytes are no longer guaranteed. FAILED_PRECONDITION in a forked
// child, INVALID_ARGUMENT for a tensor that did not come from a tensorshm Client.
TENSORSHM_EXPORT Status LeaseStatus(const DLManagedTensorVersioned* tensor);

// The library's own: what these classes hide (client/).
class ClientAccess;
class ClientCore;
class CancelState;
class WritableTensorState;

// A tensor being filled by its producer. Move-only. Dropping it unpublished frees its buffer
// (asynchronously, through the session stream). Not thread-safe.
//
// Its host buffer lies in this process's writable mapping of the whole segment, which the client
// keeps for the segment's life: a buffer of a size seen before costs no mmap and no page faults.
// "Sealed" is an API promise: once published, no client API hands out a writable pointer to the
// buffer (data() is nullptr). A pointer kept from before the publish still writes into it (the
// producer's process holds a writable descriptor of its own uid's segments, as in Plasma and
// iceoryx), and consumers would see such writes: don't keep one.
class TENSORSHM_EXPORT WritableTensor {
 public:
  WritableTensor(WritableTensor&& other) noexcept;
  WritableTensor& operator=(WritableTensor&& other) noexcept;
  WritableTensor(const WritableTensor&) = delete;
  WritableTensor& operator=(const WritableTensor&) = delete;
  ~WritableTensor();

  // data points at the producer's writable mapping; after Publish it is nullptr. A moved-from
  // tensor is empty: no data, ids and sizes 0.
  const DLTensor& dl_tensor() const;
  // dl_tensor().data + byte_offset: element [0, ..., 0]. nullptr once published.
  void* data() const;
  uint64_t tensor_id() const;
  int64_t nbytes() const;
  // DLPack flags describing the storage (DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED or 0).
  uint64_t dlpack_flags() const;
  // For bindings that keep views of the buffer alive past Publish (they must hold a lease on the
  // tensor too): makes the buffer read-only in this process, so that a write through such a view
  // faults (SIGSEGV) instead of changing bytes consumers read, until the buffer is freed and
  // handed out again. The segment's mapping stays valid while this WritableTensor lives.
  // FAILED_PRECONDITION before Publish; OK for tensors with no host buffer; errors of mprotect.
  Status SealViews();
  // The address the buffer had while writable (nullptr for no host buffer), for such views.
  void* buffer_address() const;
  bool published() const;

 private:
  friend class WritableTensorState;
  explicit WritableTensor(std::unique_ptr<WritableTensorState> state);

  std::unique_ptr<WritableTensorState> state_;  // null once moved from
};

// Cancels waits: pass one to Acquire or Create (with a timeout), from any number of threads,
// and call Cancel() from any thread to wake them. Copies share one state. Thread-safe.
//
//   tensorshm::WaitCanceller cancel;
//   std::thread waiter([&] { auto t = client->Acquire("x", tensorshm::kForever,
//                                                     tensorshm::ReadySync::Host(), cancel); });
//   cancel.Cancel();  // the Acquire answers CANCELLED, holding no lease
class TENSORSHM_EXPORT WaitCanceller {
 public:
  WaitCanceller();
  // Wakes every call waiting with this canceller now (it answers CANCELLED, and the daemon
  // keeps no lease or buffer for it), and makes every later call given it answer CANCELLED
  // before waiting. A call whose answer was already on its way may still succeed. Idempotent.
  void Cancel() const;
  bool cancelled() const;

 private:
  friend class ClientAccess;
  std::shared_ptr<CancelState> state_;
};

// A connection to tensorshmd: one session. Thread-safe. Tensors acquired through it stay valid
// after the Client is destroyed, until their deleters run; the session stays open until then.
//
// A Client belongs to the process that connected. In a child made by fork(), every call on an
// inherited Client answers FAILED_PRECONDITION (connect again there), and destroying it, or
// deleting tensors or writable tensors inherited from it, does nothing to the parent's session.
class TENSORSHM_EXPORT Client {
 public:
  // Connects to tensorshmd and opens a session. UNAVAILABLE naming the socket if the daemon does
  // not accept the connection and open the session within options.connect_timeout (a stopped
  // daemon included), and at once if there is no socket file at the path; PERMISSION_DENIED if
  // the socket is served by a uid the client does not trust (see ClientOptions::server_uid; the
  // check is made on every connection, reconnects included).
  //
  // If the daemon goes away later, the client reconnects on its own in the background (backoff
  // from 50 ms to 2 s; every 100 ms while a call waits for it; each attempt bounded by
  // connect_timeout) and re-registers the leases and unpublished tensors it still holds; a
  // daemon restarted with the same --shm-prefix keeps them for its --recovery-grace. Tensors
  // stay mapped and readable throughout. A call that finds the session ended (before it is sent
  // or while it is in flight) waits for the reconnect and runs again on the new session, while
  // its deadline has not passed: its timeout when positive, else 60 s (a call that does not wait,
  // or waits without end). That is done for the calls that are harmless to repeat (Acquire,
  // Create, Delete, List, Stat, Sessions); a Publish in flight when the session ended is not
  // repeated, since the daemon may have committed it: it answers UNAVAILABLE saying its fate is
  // unknown (look, e.g. Acquire or List the name, before publishing again). What the restarted
  // daemon did not take back is reported, never silently dropped: Flush() answers DATA_LOSS,
  // LeaseStatus() does for each such tensor, and Publish() of such a writable tensor too.
  //
  // Segment memory is reached through descriptors the daemon passes over a second connection
  // on the same socket (the memory channel); the client never opens shared memory by name, and
  // keys every mapping by the daemon instance that made the segment, so a daemon restarted
  // under the same names never serves old bytes from a stale mapping.
  static StatusOr<std::shared_ptr<Client>> Connect(const ClientOptions& options = {});
  // As Connect; `cancel`.Cancel() ends the wait for the daemon (connecting, or opening the
  // session) with CANCELLED.
  static StatusOr<std::shared_ptr<Client>> Connect(const ClientOptions& options,
                                                   const WaitCanceller& cancel);

  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Allocates a writable tensor. INVALID_ARGUMENT for a bad dtype, shape, strides or device,
  // RESOURCE_EXHAUSTED if the pool is full, FAILED_PRECONDITION for a device without a pool.
  // A CUDA tensor (device {kDLCUDA, N}, N in this process's numbering) gets a writable device
  // pointer into the daemon's pool for that device. On a VMM pool (the default) it is writable
  // until Publish: then it turns read-only in this process too, once the ready event has
  // completed (pieces of whole granules shared with another unpublished buffer of this process
  // stay writable until that one's publish; see docs/gpu.md).
  //
  // What a new buffer holds before the producer writes it is unspecified, within this promise:
  // zeros (memory never used since its segment was made) or bytes left over from earlier tensors
  // of the same uid (buffers are reused without clearing: clearing would cost a write of every
  // byte). Bytes of another uid's tensors never reach it: each uid's buffers lie in segments of
  // their own. Write every byte you publish.
  StatusOr<WritableTensor> Create(const TensorSpec& spec);

  // As Create; when the pool cannot hold the buffer, waits up to `timeout` in the daemon for
  // memory to be freed (a delete, a lease ending, a client leaving, an eviction), then
  // RESOURCE_EXHAUSTED saying how long it waited. Zero: as Create (fails at once);
  // kForever: waits until memory comes. Waiting creates are served in order, per
  // pool (and per uid on the host pool): while one waits, later creates for the same memory
  // queue behind it, and those without a timeout fail at once. Quotas (--session-quota,
  // --uid-quota) never wait; a waiting create counts against --uid-waiters.
  StatusOr<WritableTensor> Create(const TensorSpec& spec, Duration timeout);
  // As Create with a timeout; `cancel`.Cancel() ends the wait for memory with CANCELLED.
  StatusOr<WritableTensor> Create(const TensorSpec& spec, Duration timeout,
                                  const WaitCanceller& cancel);

  // Seals `tensor` and binds it to `name`, dropping the writable mapping. ALREADY_EXISTS if
  // `name` is bound and !replace; with replace the old tensor lives on for its leases.
  // INVALID_ARGUMENT for a bad name; FAILED_PRECONDITION if `tensor` is already published;
  // DATA_LOSS if a restarted daemon did not take the unpublished tensor back. On failure
  // `tensor` is unchanged and may be published again.
  // CUDA tensors: an interprocess event is recorded on `ready_stream` (the stream the writes were
  // issued on) and handed to acquirers, who wait on it before reading.
  Status Publish(WritableTensor& tensor, std::string_view name, bool replace = false,
                 CudaStream ready_stream = kLegacyDefaultStream);

  // As Publish, and in the same step acquires a lease on the published tensor, so that no other
  // process can replace or delete it in between: the result is what Acquire(name) would return.
  // Caller owns the result and calls its deleter exactly once.
  StatusOr<DLManagedTensorVersioned*> PublishAndAcquire(
      WritableTensor& tensor, std::string_view name, bool replace = false,
      CudaStream ready_stream = kLegacyDefaultStream);

  // Acquires a lease on the tensor published as `name`. With a positive timeout, waits up to that
  // long for a publish (DEADLINE_EXCEEDED after); zero: NOT_FOUND at once if unbound;
  // kForever: waits until published. The result is read-only
  // (DLPACK_FLAG_BITMASK_READ_ONLY); its deleter gives the lease back. Host tensors are mapped
  // read-only, and so are CUDA tensors of a VMM pool (the default): a write through the pointer
  // is refused by the GPU. On a legacy pool (--cuda-pool-kind ipc) the flag is advisory: CUDA IPC
  // opens the whole segment writable. CUDA tensors come as kDLCUDA with this process's device
  // ordinal (found by the device's UUID), their segment mapped once and cached; once it is, an
  // acquire is answered from shared memory as for host tensors (no call to the daemon). `sync`
  // says who waits for the producer's ready event (opened once per process; nothing waits once
  // it has completed).
  // Caller owns the result and calls its deleter exactly once.
  StatusOr<DLManagedTensorVersioned*> Acquire(std::string_view name,
                                              Duration timeout = Duration::zero(),
                                              ReadySync sync = ReadySync::Host());
  // As Acquire; `cancel`.Cancel() ends the wait for a publish with CANCELLED (promptly: a wait
  // in the daemon is cancelled, one on the fast path woken), and no lease is left behind.
  StatusOr<DLManagedTensorVersioned*> Acquire(std::string_view name, Duration timeout,
                                              ReadySync sync, const WaitCanceller& cancel);
  // As Acquire, answered from this process's fast path alone: no RPC (for event loops that must
  // not block; the one exchange with the daemon left is the memory channel's, for a segment this
  // process has not mapped yet). With `wait` zero it does not wait; otherwise it waits up to `wait`
  // for the name's publish on the fast path, in this thread (woken by the publish itself; a signal
  // cuts the wait short). NOT_FOUND if the name is not published (within `wait`); UNAVAILABLE
  // where only the daemon can answer (no fast path, a CUDA tensor, the session's lease slots all
  // taken): then call Acquire, off the loop. The lease's ready event is not waited for
  // (ReadySync::None()).
  StatusOr<DLManagedTensorVersioned*> TryAcquireLocal(std::string_view name,
                                                      Duration wait = Duration::zero());
  // As Acquire, as a pre-1.0 DLManagedTensor (which cannot say it is read-only).
  StatusOr<DLManagedTensor*> AcquireLegacy(std::string_view name,
                                           Duration timeout = Duration::zero(),
                                           ReadySync sync = ReadySync::Host());

  // Unbinds `name`; memory is freed once its last lease ends. NOT_FOUND if unbound.
  Status Delete(std::string_view name);
  StatusOr<std::vector<TensorInfo>> List(std::string_view prefix = "");
  StatusOr<ServerStats> Stat();
  // Every session the daemon has open, this one included (own), by session id.
  // PERMISSION_DENIED if the daemon does not admit this uid.
  StatusOr<std::vector<SessionInfo>> Sessions();

  // Blocks until every release queued before the call has been applied by the daemon, and the
  // client's background work for mappings made before it is done (the rest of a newly mapped
  // segment, and stocked buffers, populated on its sender thread: after it, reads of mapped
  // tensors and fills of reused buffers fault in no thread of the process). Returns
  // the first refusal the daemon reported for those releases, DATA_LOSS if since the last Flush
  // a restarted daemon did not take back leases or unpublished tensors of this client (naming
  // their tensor ids), or UNAVAILABLE if the session ended (the client then reconnects on its
  // own; see Connect).
  Status Flush();

  // The daemon's number for the session, in decimal: what tensorshmctl sessions, Sessions() and
  // the daemon's log call its session id (a new one after reconnecting). Never the session's
  // secret token. A restarted daemon numbers its sessions from 1 again: daemon_instance() tells
  // which daemon a number belongs to.
  std::string session_id() const;
  // The daemon instance serving the session (SessionOpened.instance_id: a new one after the
  // daemon restarted), and the socket path the client connects to.
  uint64_t daemon_instance() const;
  const std::string& socket() const;

 private:
  friend class ClientAccess;
  explicit Client(std::shared_ptr<ClientCore> core);

  // The session, its sender thread and everything the tensors handed out share.
  std::shared_ptr<ClientCore> core_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_H_
