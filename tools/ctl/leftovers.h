// `tensorshmctl leftovers`: the /dev/shm objects of shm prefixes no live tensorshmd holds (a
// daemon that was SIGKILLed, crashed, or stopped with --keep-segments), listed and, with
// --remove, removed. A prefix is live while a daemon holds its lock (common/base/prefix_lock.h);
// its objects are never touched.
#ifndef TENSORSHM_TOOLS_CTL_LEFTOVERS_H_
#define TENSORSHM_TOOLS_CTL_LEFTOVERS_H_

#include <nlohmann/json.hpp>
#include <string>

namespace tensorshm::ctl {

// Scans /dev/shm for tensorshm prefixes: "<prefix>.lock", "<prefix>.ctl" (a control
// segment, told by its magic) and "<prefix>.cpu.<n>" files of this user (every user's, as root).
// With `only_prefix` non-empty, that prefix alone. Each prefix whose lock nobody holds is a
// leftover; with `remove`, its objects are removed while tensorshmctl holds its lock, so that no
// daemon starts on it meanwhile. Returns the report (docs/tensorshmctl.md):
//   {"leftovers": [{prefix, objects: [{name, bytes}], bytes, last_holder: {pid, host, socket,
//                   state} or null, kept, removed, error}],
//    "live": [{prefix, holder: {...}}]}
// `*failed` is set if a prefix could not be checked or removed (its entry says why).
nlohmann::json LeftoversReport(const std::string& only_prefix, bool remove, bool* failed);

// The report as text for a person, ending in a newline.
std::string LeftoversText(const nlohmann::json& report, bool remove);

}  // namespace tensorshm::ctl

#endif  // TENSORSHM_TOOLS_CTL_LEFTOVERS_H_
