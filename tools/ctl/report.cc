#include "tools/ctl/report.h"

#include <algorithm>
#include <cinttypes>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/tensor/dtype.h"
#include "common/tensor/wire.h"

namespace tensorshm::ctl {
namespace {

using nlohmann::json;

// Seconds from `then_unix_ms` to `now_unix_ms`, never negative; null if `then` is unknown (0).
json AgeSeconds(int64_t then_unix_ms, int64_t now_unix_ms) {
  if (then_unix_ms <= 0) return nullptr;
  return static_cast<double>(std::max<int64_t>(0, now_unix_ms - then_unix_ms)) / 1000.0;
}

// A positive value, or null: what the daemon reports as 0 when it does not know.
json KnownOrNull(int64_t value) { return value > 0 ? json(value) : json(nullptr); }

// Columns left-aligned, two spaces apart; the first row is the header.
std::string Table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()), 0);
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      absl::StrAppend(&line, row[i]);
      if (i + 1 < row.size()) line.append(widths[i] - row[i].size() + 2, ' ');
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

std::string Shape(const json& dims) {
  std::vector<int64_t> values = dims.get<std::vector<int64_t>>();
  return absl::StrCat("[", absl::StrJoin(values, ", "), "]");
}

// "45s" for a known age in seconds (a JSON number), "-" for null.
std::string Age(const json& seconds) {
  if (seconds.is_null()) return "-";
  return FormatAge(static_cast<int64_t>(seconds.get<double>()));
}

std::string OrDash(const json& value) {
  if (value.is_null()) return "-";
  if (value.is_string()) return value.get<std::string>().empty() ? "-" : value.get<std::string>();
  return value.dump();
}

std::string UtcTime(int64_t unix_ms) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(unix_ms),
                          absl::UTCTimeZone());
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  value /= 1024;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

std::string FormatAge(int64_t seconds) {
  if (seconds < 60) return absl::StrCat(seconds, "s");
  if (seconds < 3600) return absl::StrFormat("%dm%02ds", seconds / 60, seconds % 60);
  if (seconds < 86400) return absl::StrFormat("%dh%02dm", seconds / 3600, seconds % 3600 / 60);
  return absl::StrFormat("%dd%02dh", seconds / 86400, seconds % 86400 / 3600);
}

json StatusReport(const ServerStats& stats) {
  json pools = json::array();
  for (const PoolStats& pool : stats.pools) {
    pools.push_back({{"device", DeviceName(pool.device)},
                     {"device_type", static_cast<int>(pool.device.device_type)},
                     {"device_id", pool.device.device_id},
                     {"capacity_bytes", pool.capacity_bytes},
                     {"used_bytes", pool.used_bytes},
                     {"stock_bytes", pool.stock_bytes},
                     {"segments", pool.segments},
                     {"largest_free_bytes", pool.largest_free_bytes}});
  }
  return {{"sessions", stats.sessions},
          {"tensors", stats.tensors},
          {"stocked_tensors", stats.stocked_tensors},
          {"names", stats.names},
          {"leases", stats.leases},
          {"pools", std::move(pools)}};
}

json TensorReport(const TensorInfo& tensor, int64_t now_unix_ms) {
  return {
      {"name", tensor.name},
      {"tensor_id", tensor.tensor_id},
      {"dtype", DataTypeName(tensor.dtype)},
      {"dtype_code", tensor.dtype.code},
      {"dtype_bits", tensor.dtype.bits},
      {"dtype_lanes", tensor.dtype.lanes},
      {"shape", tensor.shape},
      {"strides", tensor.strides},
      {"byte_offset", tensor.byte_offset},
      {"device", DeviceName(tensor.device)},
      {"device_type", static_cast<int>(tensor.device.device_type)},
      {"device_id", tensor.device.device_id},
      {"nbytes", tensor.nbytes},
      {"flags", tensor.dlpack_flags},
      {"subbyte_padded", (tensor.dlpack_flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0},
      {"leases", tensor.leases},
      {"published_unix_ms", KnownOrNull(tensor.published_unix_ms)},
      {"age_seconds", AgeSeconds(tensor.published_unix_ms, now_unix_ms)},
      {"publisher_uid", tensor.publisher_uid},
      {"publisher_pid", KnownOrNull(tensor.publisher_pid)}};
}

json ListReport(const std::vector<TensorInfo>& tensors, int64_t now_unix_ms) {
  json list = json::array();
  for (const TensorInfo& tensor : tensors) {
    list.push_back({{"name", tensor.name},
                    {"tensor_id", tensor.tensor_id},
                    {"dtype", DataTypeName(tensor.dtype)},
                    {"shape", tensor.shape},
                    {"device", DeviceName(tensor.device)},
                    {"nbytes", tensor.nbytes},
                    {"leases", tensor.leases},
                    {"published_unix_ms", KnownOrNull(tensor.published_unix_ms)},
                    {"age_seconds", AgeSeconds(tensor.published_unix_ms, now_unix_ms)}});
  }
  return {{"tensors", std::move(list)}};
}

json SessionsReport(const std::vector<SessionInfo>& sessions, int64_t now_unix_ms) {
  json list = json::array();
  for (const SessionInfo& session : sessions) {
    const auto withheld = [&](json value) { return session.redacted ? json(nullptr) : value; };
    list.push_back({{"session_id", session.session_id},
                    {"pid", withheld(KnownOrNull(session.pid))},
                    {"uid", session.uid},
                    {"gid", withheld(session.gid)},
                    {"client_name", withheld(session.client_name)},
                    {"client_version", withheld(session.client_version)},
                    {"leases", session.rpc_leases + session.page_leases},
                    {"rpc_leases", session.rpc_leases},
                    {"page_leases", session.page_leases},
                    {"unpublished_tensors", session.unpublished_tensors},
                    {"unpublished_bytes", session.unpublished_bytes},
                    {"waiting_acquires", session.waiting_acquires},
                    {"opened_unix_ms", session.opened_unix_ms},
                    {"age_seconds", AgeSeconds(session.opened_unix_ms, now_unix_ms)},
                    {"own", session.own},
                    {"redacted", session.redacted}});
  }
  return {{"sessions", std::move(list)}};
}

std::string StatusText(const json& report) {
  std::string out = Table({{"sessions", report["sessions"].dump()},
                           {"tensors", report["tensors"].dump()},
                           {"stocked", report["stocked_tensors"].dump()},
                           {"names", report["names"].dump()},
                           {"leases", report["leases"].dump()}});
  std::vector<std::vector<std::string>> rows = {
      {"DEVICE", "CAPACITY", "USED", "USE%", "STOCK", "LARGEST FREE", "SEGMENTS"}};
  for (const json& pool : report["pools"]) {
    const int64_t capacity = pool["capacity_bytes"].get<int64_t>();
    const int64_t used = pool["used_bytes"].get<int64_t>();
    rows.push_back({pool["device"].get<std::string>(), FormatBytes(capacity), FormatBytes(used),
                    capacity > 0 ? absl::StrFormat("%.1f%%", 100.0 * used / capacity) : "-",
                    FormatBytes(pool["stock_bytes"].get<int64_t>()),
                    FormatBytes(pool["largest_free_bytes"].get<int64_t>()),
                    pool["segments"].dump()});
  }
  return absl::StrCat(out, "\n", Table(rows));
}

std::string InspectText(const json& t) {
  std::string published = "unknown";
  if (!t["published_unix_ms"].is_null()) {
    published = absl::StrCat(UtcTime(t["published_unix_ms"].get<int64_t>()), " (",
                             Age(t["age_seconds"]), " ago)");
  }
  std::string publisher = absl::StrCat("uid ", t["publisher_uid"].dump());
  absl::StrAppend(&publisher, ", pid ", OrDash(t["publisher_pid"]));
  const uint64_t flags = t["flags"].get<uint64_t>();
  return Table({
      {"name:", t["name"].get<std::string>()},
      {"tensor id:", t["tensor_id"].dump()},
      {"dtype:",
       absl::StrCat(t["dtype"].get<std::string>(), " (code ", t["dtype_code"].dump(), ", bits ",
                    t["dtype_bits"].dump(), ", lanes ", t["dtype_lanes"].dump(), ")")},
      {"shape:", Shape(t["shape"])},
      {"strides:", absl::StrCat(Shape(t["strides"]), " (elements)")},
      {"byte offset:", t["byte_offset"].dump()},
      {"device:", t["device"].get<std::string>()},
      {"nbytes:",
       absl::StrCat(t["nbytes"].dump(), " (", FormatBytes(t["nbytes"].get<int64_t>()), ")")},
      {"flags:", absl::StrCat(absl::StrFormat("0x%x", flags),
                              t["subbyte_padded"].get<bool>() ? " (subbyte padded)" : "")},
      {"leases:", t["leases"].dump()},
      {"published:", published},
      {"publisher:", publisher},
  });
}

std::string ListText(const json& report, const std::string& prefix) {
  if (report["tensors"].empty()) {
    return prefix.empty() ? "no tensors published\n"
                          : absl::StrCat("no tensors published under \"", prefix, "\"\n");
  }
  std::vector<std::vector<std::string>> rows = {
      {"NAME", "DTYPE", "SHAPE", "DEVICE", "BYTES", "LEASES", "AGE"}};
  for (const json& t : report["tensors"]) {
    rows.push_back({t["name"].get<std::string>(), t["dtype"].get<std::string>(), Shape(t["shape"]),
                    t["device"].get<std::string>(), FormatBytes(t["nbytes"].get<int64_t>()),
                    t["leases"].dump(), Age(t["age_seconds"])});
  }
  return Table(rows);
}

std::string SessionsText(const json& report) {
  std::vector<std::vector<std::string>> rows = {
      {"ID", "PID", "UID", "GID", "CLIENT", "VERSION", "LEASES", "UNPUBLISHED", "WAITING", "AGE"}};
  for (const json& s : report["sessions"]) {
    // Client names and versions are the clients' own words: escaped, so that they cannot forge
    // lines or move the terminal's cursor.
    std::string client =
        s["redacted"].get<bool>() ? "(another uid's)" : absl::CHexEscape(OrDash(s["client_name"]));
    if (s["own"].get<bool>()) absl::StrAppend(&client, " (this command)");
    rows.push_back({s["session_id"].dump(), OrDash(s["pid"]), s["uid"].dump(), OrDash(s["gid"]),
                    client, absl::CHexEscape(OrDash(s["client_version"])), s["leases"].dump(),
                    absl::StrCat(s["unpublished_tensors"].dump(), " (",
                                 FormatBytes(s["unpublished_bytes"].get<int64_t>()), ")"),
                    s["waiting_acquires"].dump(), Age(s["age_seconds"])});
  }
  return Table(rows);
}

}  // namespace tensorshm::ctl
