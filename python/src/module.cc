// tensorshm._tensorshm: the nanobind extension under the `tensorshm` Python package.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstring>
#include <list>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "arrow.h"
#include "common/tensor/dtype.h"
#include "common/base/mutex.h"
#include "common/tensor/name.h"
#include "common/tensor/wire.h"
#include "copy_in.h"
#include "exchange_api.h"
#include "raise_status.h"
#include "storage.h"
#include "tensor_object.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace tensorshm::python {
namespace {

constexpr char kVersioned[] = "dltensor_versioned";
constexpr char kUsedVersioned[] = "used_dltensor_versioned";
constexpr char kLegacy[] = "dltensor";
constexpr char kUsedLegacy[] = "used_dltensor";

[[noreturn]] void RaiseBufferError(const std::string& message) {
  PyErr_SetString(PyExc_BufferError, message.c_str());
  throw nb::python_error();
}

// ---- the GIL, and interpreter exit ----
//
// A thread that takes the GIL back once the interpreter is finalizing is ended by
// PyThread_exit_thread (Python < 3.14): pthread_exit's forced unwind through C++ frames (a
// noexcept destructor, nanobind's dispatch) aborts the process. So at exit, before threading
// joins its threads (_cancel_waits_at_exit, from threading's atexit hook), waits are cancelled
// and the hook waits for every call without the GIL to take it back; from then on this module
// no longer lets go of the GIL, and later waits fail at once. Guarded by the GIL.
bool exiting = false;
int released_regions = 0;  // ReleaseGil scopes in progress

}  // namespace

ReleaseGil::ReleaseGil() {
  if (exiting) return;
  ++released_regions;
  state_ = PyEval_SaveThread();
}

ReleaseGil::~ReleaseGil() {
  if (state_ == nullptr) return;
  PyEval_RestoreThread(static_cast<PyThreadState*>(state_));
  --released_regions;
}

namespace {

std::string Describe(const PyTensor& t) {
  return t.name.empty() ? std::string("tensor") : absl::StrCat("tensor \"", t.name, "\"");
}

// Sets tensorshm._errors.`error` (a class name) with `message` as the current Python exception.
void SetError(const char* error, const std::string& message) {
  nb::object cls = nb::module_::import_("tensorshm._errors").attr(error);
  PyErr_SetString(cls.ptr(), message.c_str());
}

std::string ReleasedMessage(const PyTensor& t) {
  return absl::StrCat(
      t.name.empty() ? std::string("tensor") : absl::StrCat("tensor '", t.name, "'"),
      " was released (release() or the end of its with block): get it again");
}

}  // namespace

const std::shared_ptr<Storage>* LiveOrSetError(const PyTensor& tensor) {
  if (tensor.storage != nullptr) return &tensor.storage;
  SetError("ReleasedError", ReleasedMessage(tensor));
  return nullptr;
}

const std::shared_ptr<Storage>& Live(const PyTensor& tensor) {
  const std::shared_ptr<Storage>* storage = LiveOrSetError(tensor);
  if (storage == nullptr) throw nb::python_error();
  return *storage;
}

namespace {

// ---- storage from the sources a Python tensor can have ----

std::shared_ptr<Storage> FromLease(DLManagedTensorVersioned* lease) {
  auto storage = std::make_shared<Storage>();
  storage->versioned = lease;
  storage->lease = true;
  storage->tensor = lease->dl_tensor;  // shape/strides stay owned by the lease
  storage->flags = lease->flags;
  storage->shape.assign(lease->dl_tensor.shape, lease->dl_tensor.shape + lease->dl_tensor.ndim);
  storage->strides.assign(lease->dl_tensor.strides,
                          lease->dl_tensor.strides + lease->dl_tensor.ndim);
  storage->tensor.shape = storage->shape.data();
  storage->tensor.strides = storage->strides.data();
  return storage;
}

std::shared_ptr<Storage> FromWritable(WritableTensor tensor) {
  auto storage = std::make_shared<Storage>();
  storage->tensor = tensor.dl_tensor();
  storage->shape.assign(storage->tensor.shape, storage->tensor.shape + storage->tensor.ndim);
  storage->strides.assign(storage->tensor.strides, storage->tensor.strides + storage->tensor.ndim);
  storage->tensor.shape = storage->shape.data();
  storage->tensor.strides = storage->strides.data();
  storage->flags = tensor.dlpack_flags();
  // The writable tensor stays in the storage, past publish: it keeps its segment's mapping, so
  // that views taken before publish stay valid after it.
  storage->writable.emplace(std::move(tensor));
  return storage;
}

// ---- __dlpack__ ----

void DestroyCapsule(PyObject* capsule) {
  // Runs when the capsule dies; a consumer that took it renamed it to used_*, and owns it now.
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (PyCapsule_IsValid(capsule, kVersioned)) {
    auto* managed =
        static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, kVersioned));
    if (managed->deleter != nullptr) managed->deleter(managed);
  } else if (PyCapsule_IsValid(capsule, kLegacy)) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kLegacy));
    if (managed->deleter != nullptr) managed->deleter(managed);
  }
  PyErr_Restore(type, value, traceback);
}

nb::object DLPack(PyTensor& self, nb::handle stream, nb::handle max_version, nb::handle dl_device,
                  nb::handle copy) {
  const DLDevice device = self.storage->tensor.device;
  const bool cuda = device.device_type == kDLCUDA;
  // DLPack stream rules: CPU tensors take None; for CUDA, None is the legacy default stream,
  // -1 asks for no synchronisation, 0 is ambiguous and refused, any other int is a CUstream.
  std::optional<CudaStream> consumer_stream;
  if (!cuda) {
    if (!stream.is_none()) {
      throw nb::value_error(
          absl::StrCat("stream = ", nb::repr(stream).c_str(), ": CPU tensors take stream=None")
              .c_str());
    }
  } else if (stream.is_none()) {
    consumer_stream = kLegacyDefaultStream;
  } else {
    const intptr_t value = nb::cast<intptr_t>(stream);
    if (value == 0) {
      throw nb::value_error(
          "stream = 0: ambiguous for CUDA in DLPack; pass 1 (legacy default stream), 2 "
          "(per-thread default stream), a CUstream, -1 (no synchronisation) or None");
    }
    if (value != -1) consumer_stream = reinterpret_cast<CudaStream>(value);
  }
  bool want_copy = false;
  if (!copy.is_none()) want_copy = nb::cast<bool>(copy);
  int wanted_type = device.device_type;  // the device type the consumer asks for
  if (!dl_device.is_none()) {
    auto [type, id] = nb::cast<std::pair<int, int>>(dl_device);
    wanted_type = type;
    const bool same = type == device.device_type && id == device.device_id;
    if (!same) {
      if (!copy.is_none() && !want_copy) {
        RaiseBufferError(absl::StrCat("dl_device = (", type, ", ", id, ") needs a copy of this ",
                                      DeviceName(device), " tensor, and copy=False forbids it"));
      }
      const bool host_like = type == kDLCPU || type == kDLCUDAHost;
      if (!host_like || (device.device_type != kDLCPU && !(cuda && type == kDLCPU))) {
        RaiseBufferError(absl::StrCat("dl_device = (", type, ", ", id, "): cannot copy a ",
                                      DeviceName(device), " tensor there"));
      }
      want_copy = true;
    }
  }
  if (cuda && want_copy && wanted_type == kDLCUDA) {
    RaiseBufferError(absl::StrCat(Describe(self), " is on ", DeviceName(device),
                                  ": copy=True makes a host copy only, with dl_device=(1, 0)"));
  }
  // A host copy waits for the producer's ready event itself; a view orders the consumer's
  // stream after it.
  if (cuda && !want_copy && consumer_stream.has_value() && self.storage->lease) {
    absl::Status s;
    {
      ReleaseGil release;
      s = WaitReady(self.storage->versioned, ReadySync::Stream(*consumer_stream));
    }
    Check(s);
  }
  bool versioned = false;
  if (!max_version.is_none()) {
    auto [major, minor] = nb::cast<std::pair<int, int>>(max_version);
    (void)minor;
    versioned = major >= 1;
  }
  const bool read_only = (self.storage->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
  if (versioned) {
    DLManagedTensorVersioned* managed = Check(ExportVersioned(self.storage, want_copy));
    PyObject* capsule = PyCapsule_New(managed, kVersioned, DestroyCapsule);
    if (capsule == nullptr) {
      managed->deleter(managed);
      throw nb::python_error();
    }
    return nb::steal(capsule);
  }
  // A pre-1.0 capsule cannot say "read-only", and a consumer may write through it into memory
  // other processes read. With copy=None (the array API's "reuse if possible, copy otherwise")
  // such a consumer (JAX passes only stream=) gets a private host copy it owns; copy=False
  // refuses. A CUDA tensor is not copied behind the consumer's back: the copy would be on the
  // host, not on the device __dlpack_device__ names, so that asks for dl_device=(1, 0).
  if (read_only && !want_copy) {
    if (!copy.is_none()) {
      RaiseBufferError(absl::StrCat(
          Describe(self), " is read-only shared memory; a pre-1.0 DLPack capsule (max_version=",
          nb::repr(max_version).c_str(),
          ") cannot say so, and copy=False forbids a private copy. Pass max_version=(1, 0) or "
          "later (numpy >= 2.1, torch >= 2.4), or ",
          cuda ? "dl_device=(1, 0) for a host copy." : "copy=None/True for a private copy."));
    }
    if (cuda) {
      RaiseBufferError(absl::StrCat(
          Describe(self), " is read-only ", DeviceName(device),
          " memory, and a pre-1.0 DLPack capsule (max_version=", nb::repr(max_version).c_str(),
          ") cannot say so; tensorshm makes no device copies. Use a consumer that passes "
          "max_version=(1, 0) or later (torch >= 2.4, cupy >= 13), or ask for a host copy "
          "with dl_device=(1, 0)."));
    }
    want_copy = true;
  }
  DLManagedTensor* managed = Check(ExportLegacy(self.storage, want_copy));
  PyObject* capsule = PyCapsule_New(managed, kLegacy, DestroyCapsule);
  if (capsule == nullptr) {
    managed->deleter(managed);
    throw nb::python_error();
  }
  return nb::steal(capsule);
}

// ---- the buffer protocol ----

const char* BufferFormat(const DLDataType& dtype) {
  if (dtype.lanes != 1) return nullptr;
  switch (dtype.code) {
    case kDLInt:
      switch (dtype.bits) {
        case 8:
          return "b";
        case 16:
          return "h";
        case 32:
          return "i";
        case 64:
          return "q";
      }
      return nullptr;
    case kDLUInt:
      switch (dtype.bits) {
        case 8:
          return "B";
        case 16:
          return "H";
        case 32:
          return "I";
        case 64:
          return "Q";
      }
      return nullptr;
    case kDLFloat:
      switch (dtype.bits) {
        case 16:
          return "e";
        case 32:
          return "f";
        case 64:
          return "d";
      }
      return nullptr;
    case kDLComplex:
      switch (dtype.bits) {
        case 64:
          return "Zf";
        case 128:
          return "Zd";
      }
      return nullptr;
    case kDLBool:
      return "?";
  }
  return nullptr;
}

// What a Py_buffer's `internal` holds: its shape and strides, and the storage it views, so that
// the view stays valid when its tensor is released while the view lives.
struct BufferInternal {
  std::vector<Py_ssize_t> dims;
  std::shared_ptr<Storage> storage;
};

// Exports `storage_ptr`'s tensor as a Py_buffer on behalf of `owner`.
int ExportBuffer(PyObject* owner, const std::shared_ptr<Storage>& storage_ptr,
                 const std::string& what, Py_buffer* view, int flags, bool raw) {
  view->obj = nullptr;
  const Storage& storage = *storage_ptr;
  const DLTensor& t = storage.tensor;
  const bool read_only = (storage.flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
  const bool padded = (storage.flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
  auto fail = [](const std::string& message) {
    PyErr_SetString(PyExc_BufferError, message.c_str());
    return -1;
  };
  if ((flags & PyBUF_WRITABLE) == PyBUF_WRITABLE && read_only) {
    return fail(what + " is read-only (published tensors are sealed)");
  }
  if (t.device.device_type != kDLCPU) {
    return fail(what + " is on " + DeviceName(t.device) + ", not in host memory");
  }
  auto* holder = new BufferInternal{{}, storage_ptr};
  std::vector<Py_ssize_t>* internal = &holder->dims;
  if (raw) {
    const StorageSpan span = SpanOf(t, padded);
    view->buf = const_cast<char*>(span.start);
    view->len = span.nbytes;
    view->itemsize = 1;
    view->format = (flags & PyBUF_FORMAT) ? const_cast<char*>("B") : nullptr;
    view->ndim = 1;
    internal->assign({span.nbytes, 1});
    view->shape = internal->data();
    view->strides = internal->data() + 1;
  } else {
    const char* format = BufferFormat(t.dtype);
    if (format == nullptr) {
      delete holder;
      return fail(what + " has dtype " + DataTypeName(t.dtype) +
                  ", which the buffer protocol cannot describe; use tensorshm.to_numpy(t) or "
                  "np.from_dlpack(t)");
    }
    const int64_t item = ElementBits(t.dtype) / 8;
    int64_t numel = 1;
    bool c_contiguous = true;
    bool f_contiguous = true;
    int64_t c_step = 1, f_step = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && t.strides[i] != c_step) c_contiguous = false;
      c_step *= t.shape[i];
    }
    for (int i = 0; i < t.ndim; ++i) {
      if (t.shape[i] != 1 && t.strides[i] != f_step) f_contiguous = false;
      f_step *= t.shape[i];
      numel *= t.shape[i];
    }
    if ((flags & PyBUF_C_CONTIGUOUS) == PyBUF_C_CONTIGUOUS && !c_contiguous) {
      delete holder;
      return fail(what + " is not C-contiguous");
    }
    if ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS && !f_contiguous) {
      delete holder;
      return fail(what + " is not Fortran-contiguous");
    }
    if ((flags & PyBUF_ANY_CONTIGUOUS) == PyBUF_ANY_CONTIGUOUS && !c_contiguous && !f_contiguous) {
      delete holder;
      return fail(what + " is not contiguous");
    }
    if ((flags & PyBUF_STRIDES) != PyBUF_STRIDES && !c_contiguous) {
      delete holder;
      return fail(what + " is strided and the consumer did not ask for strides");
    }
    view->buf = static_cast<char*>(t.data) + t.byte_offset;
    view->len = numel * item;
    view->itemsize = item;
    view->format = (flags & PyBUF_FORMAT) ? const_cast<char*>(format) : nullptr;
    view->ndim = t.ndim;
    internal->resize(2 * t.ndim);
    for (int i = 0; i < t.ndim; ++i) {
      (*internal)[i] = t.shape[i];
      (*internal)[t.ndim + i] = t.strides[i] * item;
    }
    view->shape = internal->data();
    view->strides = internal->data() + t.ndim;
  }
  view->readonly = read_only ? 1 : 0;
  view->suboffsets = nullptr;
  view->internal = holder;
  view->obj = owner;
  Py_INCREF(owner);
  return 0;
}

void ReleaseBuffer(PyObject*, Py_buffer* view) {
  delete static_cast<BufferInternal*>(view->internal);  // possibly the storage's last reference
}

int TensorGetBuffer(PyObject* self, Py_buffer* view, int flags) {
  const PyTensor* t = nb::inst_ptr<PyTensor>(nb::handle(self));
  const std::shared_ptr<Storage>* storage = LiveOrSetError(*t);
  if (storage == nullptr) {
    view->obj = nullptr;
    return -1;
  }
  return ExportBuffer(self, *storage, Describe(*t), view, flags, /*raw=*/false);
}

// The bytes of a tensor's storage, 1-d, for building numpy views of dtypes the buffer protocol
// cannot name (ml_dtypes).
struct RawStorage {
  std::shared_ptr<Storage> storage;
};

int RawGetBuffer(PyObject* self, Py_buffer* view, int flags) {
  const RawStorage* raw = nb::inst_ptr<RawStorage>(nb::handle(self));
  return ExportBuffer(self, raw->storage, "tensor storage", view, flags, /*raw=*/true);
}

PyType_Slot tensor_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(TensorGetBuffer)},
                              {Py_bf_releasebuffer, reinterpret_cast<void*>(ReleaseBuffer)},
                              {0, nullptr}};
PyType_Slot raw_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(RawGetBuffer)},
                           {Py_bf_releasebuffer, reinterpret_cast<void*>(ReleaseBuffer)},
                           {0, nullptr}};

// ---- Client ----

// Calls in progress that may wait (for a publish, or for memory), each with the canceller that
// wakes it and the client it runs on: close() cancels its client's, interpreter exit all.
// Guarded by the GIL.
struct WaitingCall {
  const ClientState* client;
  WaitCanceller cancel;
};
std::list<WaitingCall>& WaitingCalls() {
  static auto* calls = new std::list<WaitingCall>;  // never destroyed: used at exit
  return *calls;
}

std::string DescribeClient(const ClientState& state) {
  return absl::StrCat("tensorshm client of session ", state.session_id,
                      " (tensorshmd at unix:", state.socket, ")");
}

}  // namespace

ClientRef Live(const ClientState& state) {
  if (state.client == nullptr) {
    SetError("ClosedError",
             DescribeClient(state) + " is closed: connect again with tensorshm.connect()");
    throw nb::python_error();
  }
  return ClientRef(state.client);
}

namespace {

// How often a wait on the main thread runs Python's signal handlers (Ctrl-C): well under the
// 100 ms a user notices.
constexpr absl::Duration kSignalCheck = absl::Milliseconds(50);

// Whether this thread is the one Python runs signal handlers on (threading.main_thread()).
bool OnSignalThread() {
  nb::object main = nb::module_::import_("threading").attr("main_thread")();
  return nb::cast<unsigned long>(main.attr("ident")) == PyThread_get_thread_ident();
}

// What a wait got that nobody will take (a signal ended it): given back.
void Discard(absl::StatusOr<DLManagedTensorVersioned*>& result) {
  if (result.ok() && *result != nullptr) (*result)->deleter(*result);
}
void Discard(absl::StatusOr<WritableTensor>& result) { result = absl::CancelledError(""); }

// Runs `work()` on a thread of its own into `result` while this thread (which holds the GIL)
// runs Python's signal handlers every kSignalCheck. A handler that raises (KeyboardInterrupt)
// cancels `cancel`, so `work` ends soon; returns true then, with the handler's exception set
// (the caller gives back what `result` holds and raises it).
template <typename T, typename Work>
bool RunHearingSignals(WaitCanceller& cancel, T& result, Work&& work) {
  struct Done {
    Mutex mu;
    CondVar cv;
    bool done ABSL_GUARDED_BY(mu) = false;
  } done;
  std::thread worker([&] {
    T got = work();
    MutexLock lock(&done.mu);
    result = std::move(got);
    done.done = true;
    done.cv.Signal();
  });
  bool interrupted = false;
  while (true) {
    {
      ReleaseGil release;
      MutexLock lock(&done.mu);
      if (!done.done) done.cv.WaitWithTimeout(&done.mu, kSignalCheck);
      if (done.done) break;
    }
    if (!interrupted && PyErr_CheckSignals() != 0) {
      interrupted = true;  // the handler's exception is set; the wait ends soon
      cancel.Cancel();
    }
  }
  ReleaseGil release;
  worker.join();
  return interrupted;
}

// Runs `call(cancel)` (which may wait) with the GIL released, registered so that close() and
// interpreter exit can wake it. `given`: the caller's canceller (asyncio), else a fresh one.
// A wait that ends CANCELLED raises ClosedError if its client was closed meanwhile, else
// CancelledError (saying why if the interpreter is exiting).
//
// On the main thread the wait hears signals: `quick(&again)` is tried first (the answer when it
// has one, nullopt else); while it sets `again` (it waited up to kSignalCheck in this thread, as
// a get waits on the fast path, and may wait more) it is tried again after Python's signal
// handlers ran. Then `call` runs on a thread of its own while this thread runs the handlers every
// kSignalCheck. A handler that raises (KeyboardInterrupt) cancels the wait, which ends at once;
// whatever it got is given back (a lease released, a buffer dropped; a grant that crossed the
// cancel is settled by the daemon) and the handler's exception propagates.
template <typename T, typename Quick, typename Call>
T RunWaiting(const ClientState& state, const std::optional<WaitCanceller>& given, Quick&& quick,
             Call&& call) {
  WaitCanceller cancel = given.has_value() ? *given : WaitCanceller();
  if (exiting) cancel.Cancel();
  const bool hears_signals = !exiting && OnSignalThread();
  if (hears_signals) {
    while (true) {
      std::optional<T> answer;
      bool again = false;
      {
        ReleaseGil release;
        answer = quick(&again);
      }
      if (answer.has_value()) return *std::move(answer);
      if (!again) break;
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      Live(state);  // closed meanwhile (by another thread): raises ClosedError
    }
  }
  std::list<WaitingCall>& calls = WaitingCalls();
  auto it = calls.insert(calls.end(), WaitingCall{&state, cancel});
  T result;
  if (!hears_signals) {
    ReleaseGil release;
    result = call(cancel);
  } else {
    const bool interrupted = RunHearingSignals(cancel, result, [&] { return call(cancel); });
    if (interrupted) {
      calls.erase(it);
      Discard(result);
      throw nb::python_error();
    }
  }
  calls.erase(it);
  if (!result.ok() && absl::IsCancelled(result.status())) {
    if (state.client == nullptr) {
      SetError("ClosedError",
               absl::StrCat(result.status().message(), ", as the ", DescribeClient(state),
                            " was closed (close() or the end of its with block)"));
      throw nb::python_error();
    }
    if (exiting) {
      SetError("CancelledError",
               absl::StrCat(result.status().message(), ": the Python interpreter is exiting"));
      throw nb::python_error();
    }
  }
  return result;
}

absl::Duration TimeoutFrom(const std::optional<double>& seconds) {
  if (!seconds.has_value()) return absl::InfiniteDuration();
  if (std::isnan(*seconds) || *seconds < 0) {
    Raise(
        absl::InvalidArgumentError(absl::StrCat("timeout = ", *seconds, ": must be >= 0 or None")));
  }
  if (std::isinf(*seconds)) return absl::InfiniteDuration();
  return absl::Seconds(*seconds);
}

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
  absl::StatusOr<DLManagedTensorVersioned*> lease;
  // CUDA tensors: consumers' streams wait for the ready event in __dlpack__.
  if (wait == absl::ZeroDuration()) {
    ReleaseGil release;
    lease = client->Acquire(name, wait, ReadySync::None());
  } else {
    using Result = absl::StatusOr<DLManagedTensorVersioned*>;
    const absl::Time deadline =
        wait == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + wait;
    lease = RunWaiting<Result>(
        *self.state, cancel,
        [&](bool* again) -> std::optional<Result> {
          // The fast path waits in this thread, woken by the publish itself: no thread to wait
          // on, whose wake-up would come on top.
          const absl::Duration left = deadline - absl::Now();
          Result local =
              client->TryAcquireLocal(name, std::clamp(left, absl::ZeroDuration(), kSignalCheck));
          if (absl::IsUnavailable(local.status())) return std::nullopt;  // the daemon answers
          if (!absl::IsNotFound(local.status())) return local;
          if (absl::Now() < deadline) {
            *again = true;
            return std::nullopt;
          }
          return Result(absl::DeadlineExceededError(absl::StrCat(
              "name = \"", name, "\": not published within ", absl::FormatDuration(wait))));
        },
        [&](const WaitCanceller& c) {
          const absl::Duration left = wait == absl::InfiniteDuration()
                                          ? wait
                                          : std::max(absl::ZeroDuration(), deadline - absl::Now());
          return client->Acquire(name, left, ReadySync::None(), c);
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
  absl::StatusOr<WritableTensor> tensor;
  if (wait == absl::ZeroDuration()) {
    ReleaseGil release;
    tensor = client->Create(spec, wait);
  } else {
    using Result = absl::StatusOr<WritableTensor>;
    tensor = RunWaiting<Result>(
        *self.state, cancel,
        [&](bool*) -> std::optional<Result> {
          // Memory free now: no wait.
          Result now = client->Create(spec, absl::ZeroDuration());
          if (absl::IsResourceExhausted(now.status())) return std::nullopt;
          return now;
        },
        [&](const WaitCanceller& c) { return client->Create(spec, wait, c); });
  }
  PyWritableTensor out;
  out.storage = FromWritable(Check(std::move(tensor)));
  out.client = self.state;
  return out;
}

// Publishes `tensor` and returns the sealed tensor holding a lease on it.
void PublishWritable(PyWritableTensor& self, const std::string& name, bool replace) {
  const std::shared_ptr<Storage> pinned = Live(self);
  Storage& storage = *pinned;
  if (!storage.writable.has_value() || storage.writable->published()) {
    Raise(absl::FailedPreconditionError(absl::StrCat(Describe(self), ": already published")));
  }
  ClientRef client = Live(*self.client);
  absl::StatusOr<DLManagedTensorVersioned*> lease;
  {
    ReleaseGil release;
    lease = client->PublishAndAcquire(*storage.writable, name, replace);
  }
  DLManagedTensorVersioned* held = Check(std::move(lease));
  // Sealed: views taken while writing stay valid (the lease keeps the buffer) but read-only: a
  // write through one faults rather than change what consumers read. Without such views (only
  // this tensor object and `pinned` hold the storage), the buffer stays as it is, and costs no
  // mprotect now or when it is handed out again.
  if (pinned.use_count() > 2) {
    if (absl::Status s = storage.writable->SealViews(); !s.ok()) {
      held->deleter(held);
      Raise(s);
    }
  }
  storage.versioned = held;
  storage.lease = true;
  storage.flags |= DLPACK_FLAG_BITMASK_READ_ONLY;
  self.name = name;
}

// Copies `source` into a new tensor and publishes it. CUDA sources are copied on `stream` (the
// stream their producer's work is ordered on), which the ready event is then recorded on.
// `cancel`: the caller's canceller for the wait for memory (only with release_gil: a wait with
// the GIL held cannot be cancelled from Python).
PyTensor PutFromDLTensor(PyClient& self, const std::string& name, const DLTensor& source,
                         uint64_t flags, bool replace, absl::Duration timeout, bool release_gil,
                         CudaStream stream = kLegacyDefaultStream,
                         const std::optional<WaitCanceller>& cancel = std::nullopt) {
  ClientRef client = Live(*self.state);
  using Result = absl::StatusOr<DLManagedTensorVersioned*>;
  auto run_for = [&](absl::Duration wait, const WaitCanceller* c) -> Result {
    absl::StatusOr<WritableTensor> tensor = CopyIn(*client, source, flags, stream, wait, c);
    if (!tensor.ok()) return tensor.status();
    return client->PublishAndAcquire(*tensor, name, replace, stream);
  };
  auto run = [&](const WaitCanceller* c) -> Result { return run_for(timeout, c); };
  Result lease;
  if (!release_gil) {
    lease = run(nullptr);
  } else if (timeout == absl::ZeroDuration()) {
    ReleaseGil release;
    lease = run(nullptr);
  } else {
    lease = RunWaiting<Result>(
        *self.state, cancel,
        [&](bool*) -> std::optional<Result> {
          // Memory free now: no wait (a full pool fails the copy before it starts).
          Result now = run_for(absl::ZeroDuration(), nullptr);
          if (absl::IsResourceExhausted(now.status())) return std::nullopt;
          return now;
        },
        [&](const WaitCanceller& c) { return run(&c); });
  }
  return PyTensor{FromLease(Check(std::move(lease))), name};
}

PyTensor PutCapsule(PyClient& self, const std::string& name, nb::handle capsule, bool replace,
                    const std::optional<double>& timeout,
                    const std::optional<WaitCanceller>& cancel) {
  const absl::Duration wait = TimeoutFrom(timeout);
  PyObject* object = capsule.ptr();
  if (PyCapsule_IsValid(object, kVersioned)) {
    auto* managed =
        static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(object, kVersioned));
    if (managed->version.major != DLPACK_MAJOR_VERSION) {
      throw nb::value_error(absl::StrCat("DLPack capsule of version ", managed->version.major, ".",
                                         managed->version.minor, ": only major version ",
                                         DLPACK_MAJOR_VERSION, " is understood")
                                .c_str());
    }
    PyCapsule_SetName(object, kUsedVersioned);  // consumed: the capsule's destructor lets go
    std::unique_ptr<DLManagedTensorVersioned, void (*)(DLManagedTensorVersioned*)> owned(
        managed, [](DLManagedTensorVersioned* m) {
          if (m->deleter != nullptr) m->deleter(m);
        });
    return PutFromDLTensor(self, name, managed->dl_tensor, managed->flags, replace, wait, true,
                           kLegacyDefaultStream, cancel);
  }
  if (PyCapsule_IsValid(object, kLegacy)) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(object, kLegacy));
    PyCapsule_SetName(object, kUsedLegacy);
    std::unique_ptr<DLManagedTensor, void (*)(DLManagedTensor*)> owned(managed,
                                                                       [](DLManagedTensor* m) {
                                                                         if (m->deleter != nullptr)
                                                                           m->deleter(m);
                                                                       });
    return PutFromDLTensor(self, name, managed->dl_tensor, 0, replace, wait, true,
                           kLegacyDefaultStream, cancel);
  }
  if (PyCapsule_IsValid(object, kUsedVersioned) || PyCapsule_IsValid(object, kUsedLegacy)) {
    throw nb::value_error("DLPack capsule already consumed: a capsule can be consumed only once");
  }
  throw nb::type_error("expected a DLPack capsule named \"dltensor_versioned\" or \"dltensor\"");
}

const DLPackExchangeAPI* ExchangeApiFrom(nb::handle api) {
  if (PyLong_Check(api.ptr())) {
    return reinterpret_cast<const DLPackExchangeAPI*>(nb::cast<uintptr_t>(api));
  }
  if (PyCapsule_IsValid(api.ptr(), "dlpack_exchange_api")) {
    return static_cast<const DLPackExchangeAPI*>(
        PyCapsule_GetPointer(api.ptr(), "dlpack_exchange_api"));
  }
  throw nb::type_error(
      "__dlpack_c_exchange_api__ must be a PyCapsule named \"dlpack_exchange_api\" or an int");
}

PyTensor PutExchange(PyClient& self, const std::string& name, nb::handle obj, nb::handle api_object,
                     bool replace, const std::optional<double>& timeout) {
  const absl::Duration wait = TimeoutFrom(timeout);
  const DLPackExchangeAPI* api = ExchangeApiFrom(api_object);
  if (api == nullptr || api->header.version.major != DLPACK_MAJOR_VERSION) {
    throw nb::value_error("__dlpack_c_exchange_api__: missing, or of another DLPack major version");
  }
  // No-sync exports: a CUDA tensor is copied on its producer's current work stream, so the copy
  // follows the producer's writes.
  auto producer_stream = [&](const DLDevice& device) -> CudaStream {
    void* stream = kLegacyDefaultStream;
    if (device.device_type == kDLCUDA && api->current_work_stream != nullptr &&
        api->current_work_stream(device.device_type, device.device_id, &stream) != 0) {
      throw nb::python_error();
    }
    return stream;
  };
  // The non-owning view is valid only while we hold the GIL, so its copy runs with the GIL held:
  // only when the put does not wait for memory (a wait with the GIL held would stop every other
  // thread, and close() could not wake it). Waiting puts take the owning export and wait through
  // RunWaiting, without the GIL and cancellable.
  if (api->dltensor_from_py_object_no_sync != nullptr &&
      (wait == absl::ZeroDuration() || api->managed_tensor_from_py_object_no_sync == nullptr)) {
    DLTensor view{};
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &view) != 0) throw nb::python_error();
    return PutFromDLTensor(self, name, view, 0, replace, wait, /*release_gil=*/false,
                           producer_stream(view.device));
  }
  DLManagedTensorVersioned* managed = nullptr;
  if (api->managed_tensor_from_py_object_no_sync(obj.ptr(), &managed) != 0) {
    throw nb::python_error();
  }
  std::unique_ptr<DLManagedTensorVersioned, void (*)(DLManagedTensorVersioned*)> owned(
      managed, [](DLManagedTensorVersioned* m) {
        if (m->deleter != nullptr) m->deleter(m);
      });
  return PutFromDLTensor(self, name, managed->dl_tensor, managed->flags, replace, wait, true,
                         producer_stream(managed->dl_tensor.device));
}

nb::list SessionDicts(PyClient& self) {
  ClientRef client = Live(*self.state);
  absl::StatusOr<std::vector<SessionInfo>> sessions;
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
  absl::StatusOr<ServerStats> stats;
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
    pools.append(pool);
  }
  out["pools"] = pools;
  return out;
}

absl::StatusOr<std::vector<TensorInfo>> List(PyClient& self, const std::string& prefix) {
  ClientRef client = Live(*self.state);
  ReleaseGil release;
  return client->List(prefix);
}

nb::list ListDicts(PyClient& self, const std::string& prefix) {
  absl::StatusOr<std::vector<TensorInfo>> listed = List(self, prefix);
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
absl::StatusOr<std::shared_ptr<Client>> ConnectHearingSignals(const ClientOptions& options) {
  WaitCanceller cancel;
  if (exiting) cancel.Cancel();
  std::list<WaitingCall>& calls = WaitingCalls();
  auto it = calls.insert(calls.end(), WaitingCall{nullptr, cancel});
  absl::StatusOr<std::shared_ptr<Client>> result;
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

nb::tuple ShapeOf(const PyTensor& t) { return nb::tuple(nb::cast(Live(t)->shape)); }

}  // namespace
}  // namespace tensorshm::python

NB_MODULE(_tensorshm, m) {
  using namespace tensorshm::python;
  using tensorshm::Client;
  m.doc() = "tensorshm's native layer; use the `tensorshm` package.";

  nb::class_<RawStorage>(m, "_RawStorage", nb::type_slots(raw_slots));

  nb::class_<PyTensor> tensor(m, "Tensor", nb::type_slots(tensor_slots),
                              "A tensor in tensorshm shared memory (read-only once published; "
                              "for CUDA tensors the read-only flag is advisory, as CUDA IPC maps "
                              "device memory writable).");
  tensor
      .def(
          "__dlpack__",
          [](const PyTensor& t, nb::handle stream, nb::handle max_version, nb::handle dl_device,
             nb::handle copy) {
            // A copy holding the storage: a release() in another thread while DLPack waits
            // without the GIL cannot free it.
            PyTensor pinned{Live(t), t.name};
            return DLPack(pinned, stream, max_version, dl_device, copy);
          },
          nb::kw_only(), "stream"_a = nb::none(), "max_version"_a = nb::none(),
          "dl_device"_a = nb::none(), "copy"_a = nb::none(),
          "The tensor as a DLPack capsule. With max_version >= (1, 0): a zero-copy view "
          "flagged read-only when the tensor is (numpy, torch, tvm-ffi). Without it (JAX, "
          "pre-1.0 consumers), a legacy capsule cannot say read-only: a published host "
          "tensor is then handed over as a private copy the consumer owns (copy=False "
          "refuses), and a published CUDA tensor is refused unless dl_device=(1, 0) asks for "
          "a host copy. copy=True always copies to host memory.")
      .def("__dlpack_device__",
           [](const PyTensor& t) {
             return std::make_pair(static_cast<int>(Live(t)->tensor.device.device_type),
                                   static_cast<int>(Live(t)->tensor.device.device_id));
           })
      .def_prop_ro("shape", &ShapeOf)
      .def_prop_ro("strides",
                   [](const PyTensor& t) { return nb::tuple(nb::cast(Live(t)->strides)); })
      .def_prop_ro("dtype",
                   [](const PyTensor& t) { return tensorshm::DataTypeName(Live(t)->tensor.dtype); })
      .def_prop_ro("device",
                   [](const PyTensor& t) { return tensorshm::DeviceName(Live(t)->tensor.device); })
      .def_prop_ro("nbytes",
                   [](const PyTensor& t) {
                     const bool padded =
                         (Live(t)->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
                     return SpanOf(Live(t)->tensor, padded).nbytes;
                   })
      .def_prop_ro("name",
                   [](const PyTensor& t) -> std::optional<std::string> {
                     if (t.name.empty()) return std::nullopt;
                     return t.name;
                   })
      .def_prop_ro(
          "read_only",
          [](const PyTensor& t) { return (Live(t)->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0; })
      .def_prop_ro("subbyte_padded",
                   [](const PyTensor& t) {
                     return (Live(t)->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
                   })
      .def_prop_ro(
          "alive", [](const PyTensor& t) { return Live(t)->LeaseStatus().ok(); },
          "Whether tensorshmd still reserves this tensor's memory for it. False once a restarted "
          "daemon did not take the tensor's lease back (the memory stays mapped and readable, but "
          "its bytes are no longer guaranteed), and in a process forked from the one that "
          "acquired it (the lease is the parent's); check() raises saying which. True for "
          "tensors that hold no lease: foreign tensors, and unpublished writable tensors (a "
          "restarted daemon that did not take one back makes its publish() raise DataLossError).")
      .def(
          "check", [](const PyTensor& t) { Check(Live(t)->LeaseStatus()); },
          "Returns None while the tensor is alive; otherwise raises DataLossError (a restarted "
          "daemon did not take its lease back) or FailedPreconditionError (in a forked child: "
          "connect and get it again there).")
      .def_prop_ro("_data_ptr",
                   [](const PyTensor& t) {
                     return reinterpret_cast<uintptr_t>(Live(t)->tensor.data) +
                            Live(t)->tensor.byte_offset;
                   })
      .def("_raw_storage",
           [](const PyTensor& t) {
             const std::shared_ptr<Storage>& storage = Live(t);
             const bool padded = (storage->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
             const StorageSpan span = SpanOf(storage->tensor, padded);
             return std::make_pair(RawStorage{storage}, span.element0);
           })
      .def(
          "release",
          [](PyTensor& t) {
            std::shared_ptr<Storage> storage = std::move(t.storage);
            // Views exported before (DLPack, the buffer protocol, to_numpy) hold their own
            // reference: the lease goes back with the last of them.
            storage.reset();
          },
          "Gives the tensor's lease back now (idempotent), instead of when the object is "
          "garbage collected; an unpublished WritableTensor's buffer is freed. Views already "
          "exported (np.from_dlpack, torch.from_dlpack, memoryview, np.asarray, "
          "tensorshm.to_numpy) stay valid and hold the lease until they go. Any later use of "
          "this object raises ReleasedError. The one exception: a non-owning DLTensor view "
          "taken through the C exchange API's dltensor_from_py_object_no_sync is valid only "
          "while the object is alive and not released, so don't release a tensor in one thread "
          "while a C consumer works on such a view of it in another.")
      .def_prop_ro(
          "released", [](const PyTensor& t) { return t.storage == nullptr; },
          "Whether release() was called (or the tensor's with block ended).")
      // numpy swallows a buffer protocol error and makes an object array instead; an error
      // from __array_interface__ (tried next) it raises. So a released tensor raises
      // ReleasedError from np.asarray too; a live one has no such attribute (AttributeError).
      .def_prop_ro("__array_interface__",
                   [](const PyTensor& t) -> nb::object {
                     Live(t);
                     throw nb::attribute_error("__array_interface__");
                   })
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def(
          "__exit__", [](PyTensor& t, nb::handle, nb::handle, nb::handle) { t.storage.reset(); },
          nb::arg().none(), nb::arg().none(), nb::arg().none())
      .def("__repr__", [](nb::handle self) {
        const PyTensor& t = nb::cast<const PyTensor&>(self);
        if (t.storage == nullptr) {
          return absl::StrCat(
              "tensorshm.", nb::isinstance<PyWritableTensor>(self) ? "WritableTensor" : "Tensor",
              "(", t.name.empty() ? "" : absl::StrCat("name='", t.name, "', "), "released)");
        }
        const Storage& s = *t.storage;
        return absl::StrCat(
            "tensorshm.",
            s.writable.has_value() && !s.writable->published() ? "WritableTensor" : "Tensor", "(",
            t.name.empty() ? "" : absl::StrCat("name='", t.name, "', "), "shape=(",
            absl::StrJoin(s.shape, ", "), s.shape.size() == 1 ? ",)" : ")", ", dtype='",
            tensorshm::DataTypeName(s.tensor.dtype), "', device='",
            tensorshm::DeviceName(s.tensor.device),
            "', read_only=", (s.flags & DLPACK_FLAG_BITMASK_READ_ONLY) ? "True" : "False", ")");
      });
  // The DLPack 1.3 C exchange API, on the type (consumers look it up on type(obj)).
  tensor.attr("__dlpack_c_exchange_api__") = nb::steal(
      PyCapsule_New(const_cast<DLPackExchangeAPI*>(ExchangeApi()), "dlpack_exchange_api", nullptr));
  DefineArrowExports(tensor);

  nb::class_<PyWritableTensor, PyTensor>(m, "WritableTensor",
                                         "A tensor being filled; publish() seals it.")
      .def("publish", &PublishWritable, "name"_a, "replace"_a = false)
      .def_prop_ro("published", [](const PyWritableTensor& t) {
        const std::shared_ptr<Storage>& storage = Live(t);
        return !storage->writable.has_value() || storage->writable->published();
      });

  nb::class_<tensorshm::WaitCanceller>(
      m, "_WaitCanceller", "Cancels the waits it is passed to (tensorshm's asyncio calls).")
      .def(nb::init<>())
      .def("cancel", &tensorshm::WaitCanceller::Cancel)
      .def_prop_ro("cancelled", &tensorshm::WaitCanceller::cancelled);

  nb::class_<PyClient> client(m, "_Client");
  DefineArrowImport(client);
  client
      .def_static(
          "connect",
          [](const std::optional<std::string>& socket, const std::optional<std::string>& name,
             double timeout, std::optional<int64_t> server_uid) {
            tensorshm::ClientOptions options;
            if (socket.has_value()) options.socket = *socket;
            if (name.has_value()) options.client_name = *name;
            options.connect_timeout = absl::Seconds(timeout);
            if (server_uid.has_value()) {
              if (*server_uid < 0 || *server_uid >= int64_t{UINT32_MAX}) {
                throw nb::value_error(absl::StrCat("server_uid = ", *server_uid,
                                                   ": must be a uid, 0 to ", UINT32_MAX - 1)
                                          .c_str());
              }
              options.server_uid = static_cast<uint32_t>(*server_uid);
            }
            absl::StatusOr<std::shared_ptr<Client>> client = ConnectHearingSignals(options);
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
            absl::StatusOr<DLManagedTensorVersioned*> lease = client->TryAcquireLocal(name);
            if (absl::IsUnavailable(lease.status()) || absl::IsNotFound(lease.status())) {
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
             absl::Status status;
             {
               ReleaseGil release;
               status = client->Delete(name);
             }
             Check(status);
           })
      .def("list", &ListDicts, "prefix"_a = "")
      .def("keys", &Keys, "prefix"_a = "")
      .def("contains", &Contains, "name"_a)
      .def("stat", &StatDict)
      .def("sessions", &SessionDicts)
      .def("flush",
           [](PyClient& self) {
             ClientRef client = Live(*self.state);
             absl::Status status;
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

  m.def(
      "_cancel_waits_at_exit",
      [] {
        exiting = true;
        for (WaitingCall& call : WaitingCalls()) call.cancel.Cancel();
        // The woken calls (and any other without the GIL) take it back and return. Bounded: a
        // call that does not come back (a daemon that stopped answering) is left to its fate.
        const absl::Time deadline = absl::Now() + absl::Seconds(5);
        while (released_regions > 0 && absl::Now() < deadline) {
          PyThreadState* state = PyEval_SaveThread();
          absl::SleepFor(absl::Milliseconds(1));
          PyEval_RestoreThread(state);
        }
      },
      "At interpreter exit: wakes every waiting get/create/put (they raise CancelledError), "
      "waits for calls in progress to return, and makes later waits raise at once.");

  m.def(
      "_quiet_leak_warnings", [] { nb::set_leak_warnings(false); },
      "At exit, when daemon threads are still alive: nanobind would report the tensors and "
      "clients they hold as leaked. Safe to leave: the process is exiting, and the daemon takes "
      "a session's leases and buffers back when its connection closes.");
  m.def("_after_fork_in_child", &ForgetAllocatorClientAfterFork,
        "Called in a child of os.fork(): forgets the parent's allocator client.");
  m.def("_exchange_api_calls", [] {
    const std::array<int64_t, 5> calls = ExchangeApiCalls();
    nb::dict out;
    const char* names[] = {"managed_tensor_allocator", "managed_tensor_from_py_object_no_sync",
                           "managed_tensor_to_py_object_no_sync", "dltensor_from_py_object_no_sync",
                           "current_work_stream"};
    for (int i = 0; i < 5; ++i) out[names[i]] = calls[i];
    return out;
  });
  m.def("_dtype_fields", [](const std::string& name) {
    DLDataType dtype = Check(tensorshm::ParseDataType(name));
    return std::make_tuple(static_cast<int>(dtype.code), static_cast<int>(dtype.bits),
                           static_cast<int>(dtype.lanes));
  });
  m.def("_dtype_name", [](int code, int bits, int lanes) {
    DLDataType dtype = Check(tensorshm::MakeDataType(code, bits, lanes));
    return tensorshm::DataTypeName(dtype);
  });
}
