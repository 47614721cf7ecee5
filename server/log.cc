#include "server/log.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tensorshm {
namespace {

std::atomic<LogLevel> threshold{LogLevel::kInfo};

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

LogLine::~LogLine() {
  std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()),
                   " tensorshmd ", LevelName(level_), ": ", stream_.str(), "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace tensorshm
