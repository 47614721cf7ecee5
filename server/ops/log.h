// Minimal leveled logging to stderr: TSM_LOG(kInfo) << "session " << id << " opened";
#ifndef TENSORSHM_SERVER_OPS_LOG_H_
#define TENSORSHM_SERVER_OPS_LOG_H_

#include <sstream>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorshm {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Thread-safe. The threshold below which messages are dropped; kInfo unless set.
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// "debug", "info", "warning", "error"; INVALID_ARGUMENT naming the value otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text);

// `text` (a client's string) fit for a log line: C-escaped, so that no byte of it can end the
// line or forge another, and cut to its first `max_bytes` bytes ("..." then marks the cut).
std::string LogEscape(absl::string_view text, size_t max_bytes = 256);

// One log line, written whole when the statement ends.
class LogLine {
 public:
  explicit LogLine(LogLevel level) : level_(level) {}
  ~LogLine();
  template <typename T>
  LogLine& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

}  // namespace tensorshm

#define TSM_LOG(level)                                             \
  if (::tensorshm::LogLevel::level < ::tensorshm::GetLogLevel()) { \
  } else                                                           \
    ::tensorshm::LogLine(::tensorshm::LogLevel::level)

#endif  // TENSORSHM_SERVER_OPS_LOG_H_
