#include "server/ops/log.h"

#include <atomic>
#include <memory>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace tensorshm {
namespace {

std::atomic<LogLevel> threshold{LogLevel::kInfo};

// The daemon's logger: one line per message on stderr, whole (spdlog's sink holds a lock per
// line), "2026-01-02T03:04:05.678Z tensorshmd info: message" in UTC. It filters nothing itself:
// TSM_LOG drops messages below the threshold before they are formatted.
spdlog::logger& Logger() {
  // Never destroyed: threads still running at exit may log.
  static spdlog::logger* const logger = [] {
    auto* made =
        new spdlog::logger("tensorshmd", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    made->set_formatter(std::make_unique<spdlog::pattern_formatter>(
        "%Y-%m-%dT%H:%M:%S.%eZ %n %l: %v", spdlog::pattern_time_type::utc, "\n"));
    made->set_level(spdlog::level::trace);
    made->flush_on(spdlog::level::trace);  // stderr is read by tests and supervisors as it comes
    return made;
  }();
  return *logger;
}

spdlog::level::level_enum SpdlogLevel(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarning:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
  }
  return spdlog::level::err;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
  }
  return "?";
}

}  // namespace

void SetLogLevel(LogLevel level) { threshold.store(level); }
LogLevel GetLogLevel() { return threshold.load(); }

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text) {
  for (LogLevel level : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError}) {
    if (text == LevelName(level)) return level;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--log-level = \"", text, "\": expected debug, info, warning or error"));
}

std::string LogEscape(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return absl::CHexEscape(text);
  return absl::StrCat(absl::CHexEscape(text.substr(0, max_bytes)), "...");
}

LogLine::~LogLine() { Logger().log(SpdlogLevel(level_), "{}", stream_.str()); }

}  // namespace tensorshm
