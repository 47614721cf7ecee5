// Runs tensorshmctl as the operator would, for the tests of it: a real process, its stdout and
// stderr kept apart (stdout is what -o json promises to keep parseable).
#ifndef TENSORSHM_TESTS_SUPPORT_CTL_RUN_H_
#define TENSORSHM_TESTS_SUPPORT_CTL_RUN_H_

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tensorshm::testing {

struct CtlRun {
  int exit_code = -1;  // -1: killed by a signal, or did not end within a minute
  std::string out;
  std::string err;
  // stdout parsed as JSON; a test failure (and null) if it is not JSON.
  nlohmann::json Json() const;
};

// Runs the built tensorshmctl with `args`. `env` ("NAME=value") is added to this process's
// environment, and TENSORSHM_SOCKET removed unless given there. With `as_uid` >= 0 it runs as
// that uid and gid (setpriv), with no supplementary groups. Its output goes through files in
// `dir`, removed once read.
CtlRun RunCtl(const std::string& dir, const std::vector<std::string>& args,
              const std::vector<std::string>& env = {}, int as_uid = -1);

// The rest of `text`'s first line that contains `needle`, from the needle on; "" if none.
std::string LineWith(const std::string& text, const std::string& needle);

}  // namespace tensorshm::testing

#endif  // TENSORSHM_TESTS_SUPPORT_CTL_RUN_H_
