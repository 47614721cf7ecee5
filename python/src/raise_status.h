// A status (the library's absl::Status, or the public tensorshm::Status) to Python: the tensorshm
// exception class for each status code.
#ifndef TENSORSHM_PYTHON_RAISE_STATUS_H_
#define TENSORSHM_PYTHON_RAISE_STATUS_H_

#include <nanobind/nanobind.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensorshm/status.h"

namespace tensorshm::python {

// Raises the tensorshm exception for `status` (tensorshm._errors maps codes to classes): the
// library's absl::Status or the Client API's tensorshm::Status, whose codes are the same.
// REQUIRES the GIL.
template <typename AnyStatus>
[[noreturn]] void Raise(const AnyStatus& status) {
  nanobind::module_::import_("tensorshm._errors")
      .attr("_raise_status")(static_cast<int>(status.code()), std::string(status.message()));
  throw std::runtime_error("tensorshm._errors._raise_status returned");  // unreachable
}

// The value, or the status raised as above.
template <typename T>
T Check(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}
template <typename T>
T Check(StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

inline void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}
inline void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

// Sets tensorshm._errors.`error` (a class name) with `message` as the current Python exception.
// REQUIRES the GIL.
inline void SetError(const char* error, const std::string& message) {
  nanobind::object cls = nanobind::module_::import_("tensorshm._errors").attr(error);
  PyErr_SetString(cls.ptr(), message.c_str());
}

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_RAISE_STATUS_H_
