// Calls that wait (for a publish, for memory, for the daemon) without holding up Python: the GIL
// is released meanwhile, Ctrl-C is heard on the main thread, close() wakes its client's waits,
// and interpreter exit wakes them all (and then waits for every call without the GIL to return).
#ifndef TENSORSHM_PYTHON_WAITS_H_
#define TENSORSHM_PYTHON_WAITS_H_

#include <nanobind/nanobind.h>

#include <list>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "raise_status.h"
#include "tensor_object.h"
#include "tensorshm/client.h"

namespace tensorshm::python {

// Whether the interpreter is exiting (_cancel_waits_at_exit ran): from then on waits fail at once
// and ReleaseGil keeps the GIL. Guarded by the GIL.
bool Exiting();

// Calls in progress that may wait (for a publish, or for memory), each with the canceller that
// wakes it and the client it runs on: close() cancels its client's, interpreter exit all.
// Guarded by the GIL.
struct WaitingCall {
  const ClientState* client;
  WaitCanceller cancel;
};
std::list<WaitingCall>& WaitingCalls();

// How often a wait on the main thread runs Python's signal handlers (Ctrl-C): well under the
// 100 ms a user notices.
constexpr absl::Duration kSignalCheck = absl::Milliseconds(50);

// Whether this thread is the one Python runs signal handlers on (threading.main_thread()).
// REQUIRES the GIL.
bool OnSignalThread();

// What a wait got that nobody will take (a signal ended it): given back.
inline void Discard(StatusOr<DLManagedTensorVersioned*>& result) {
  if (result.ok() && *result != nullptr) (*result)->deleter(*result);
}
inline void Discard(StatusOr<WritableTensor>& result) {
  result = Status(StatusCode::kCancelled, "");
}

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
  if (Exiting()) cancel.Cancel();
  const bool hears_signals = !Exiting() && OnSignalThread();
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
      if (PyErr_CheckSignals() != 0) throw nanobind::python_error();
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
      throw nanobind::python_error();
    }
  }
  calls.erase(it);
  if (result.status().code() == StatusCode::kCancelled) {
    if (state.client == nullptr) {
      SetError("ClosedError",
               absl::StrCat(result.status().message(), ", as the ", DescribeClient(state),
                            " was closed (close() or the end of its with block)"));
      throw nanobind::python_error();
    }
    if (Exiting()) {
      SetError("CancelledError",
               absl::StrCat(result.status().message(), ": the Python interpreter is exiting"));
      throw nanobind::python_error();
    }
  }
  return result;
}

// A timeout argument as a duration: None and inf wait forever; NaN and negative values raise
// InvalidArgumentError naming the value. REQUIRES the GIL.
absl::Duration TimeoutFrom(const std::optional<double>& seconds);

// _cancel_waits_at_exit: wakes every wait (they raise CancelledError), waits (up to 5 s) for
// every call without the GIL to take it back, and makes later waits fail at once. REQUIRES the
// GIL.
void CancelWaitsAtExit();

// _quiet_leak_warnings: nanobind's leak warnings off, for an exit with daemon threads alive.
void QuietLeakWarnings();

// Registers _WaitCanceller and _cancel_waits_at_exit.
void DefineWaits(nanobind::module_& m);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_WAITS_H_
