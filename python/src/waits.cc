#include "waits.h"

#include <cmath>

namespace nb = nanobind;

namespace tensorshm::python {
namespace {

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

bool Exiting() { return exiting; }

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

std::list<WaitingCall>& WaitingCalls() {
  static auto* calls = new std::list<WaitingCall>;  // never destroyed: used at exit
  return *calls;
}

bool OnSignalThread() {
  nb::object main = nb::module_::import_("threading").attr("main_thread")();
  return nb::cast<unsigned long>(main.attr("ident")) == PyThread_get_thread_ident();
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

void CancelWaitsAtExit() {
  exiting = true;
  for (WaitingCall& call : WaitingCalls()) call.cancel.Cancel();
  // The woken calls (and any other without the GIL) take it back and return. Bounded: a call
  // that does not come back (a daemon that stopped answering) is left to its fate.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (released_regions > 0 && absl::Now() < deadline) {
    PyThreadState* state = PyEval_SaveThread();
    absl::SleepFor(absl::Milliseconds(1));
    PyEval_RestoreThread(state);
  }
}

void QuietLeakWarnings() { nb::set_leak_warnings(false); }

void DefineWaits(nb::module_& m) {
  nb::class_<WaitCanceller>(m, "_WaitCanceller",
                            "Cancels the waits it is passed to (tensorshm's asyncio calls).")
      .def(nb::init<>())
      .def("cancel", &WaitCanceller::Cancel)
      .def_prop_ro("cancelled", &WaitCanceller::cancelled);

  m.def("_cancel_waits_at_exit", &CancelWaitsAtExit,
        "At interpreter exit: wakes every waiting get/create/put (they raise CancelledError), "
        "waits for calls in progress to return, and makes later waits raise at once.");
}

}  // namespace tensorshm::python
