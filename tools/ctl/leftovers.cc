#include "tools/ctl/leftovers.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/base/prefix_lock.h"
#include "common/base/unique_fd.h"
#include "common/shm/catalog_layout.h"
#include "tools/ctl/report.h"

namespace tensorshm::ctl {
namespace {

using nlohmann::json;

constexpr char kShmDir[] = "/dev/shm";
// As tensorshmd's --shm-prefix takes them.
constexpr size_t kMaxPrefixBytes = 48;

struct Found {
  std::map<std::string, uint64_t> objects;  // file name -> bytes
  bool lock_file = false;
  bool control = false;  // a control segment, by its magic
};

bool IsPrefix(absl::string_view prefix) {
  if (prefix.empty() || prefix.size() > kMaxPrefixBytes) return false;
  for (char c : prefix) {
    if (!absl::ascii_isalnum(c) && c != '-' && c != '_') return false;
  }
  return true;
}

// The prefix of a file name tensorshmd gives its objects ("<p>.lock", "<p>.ctl", "<p>.cpu.<n>",
// or "<p>.cpu.<n>.<16 hex digits>" for a segment whose first name was taken), or nullopt.
std::optional<std::string> PrefixOf(absl::string_view name, bool* lock, bool* control) {
  *lock = *control = false;
  absl::string_view prefix;
  if (absl::ConsumeSuffix(&name, ".lock")) {
    *lock = true;
    prefix = name;
  } else if (absl::ConsumeSuffix(&name, ".ctl")) {
    *control = true;
    prefix = name;
  } else {
    const size_t dot = name.find(".cpu.");
    if (dot == absl::string_view::npos) return std::nullopt;
    absl::string_view id = name.substr(dot + 5);
    if (const size_t suffix = id.find('.'); suffix != absl::string_view::npos) {
      uint64_t random;
      const absl::string_view hex = id.substr(suffix + 1);
      if (hex.size() != 16 || !absl::SimpleHexAtoi(hex, &random)) return std::nullopt;
      id = id.substr(0, suffix);
    }
    uint32_t index;
    if (id.empty() || !absl::ascii_isdigit(id[0]) || !absl::SimpleAtoi(id, &index) || index == 0) {
      return std::nullopt;
    }
    prefix = name.substr(0, dot);
  }
  if (!IsPrefix(prefix)) return std::nullopt;
  return std::string(prefix);
}

bool HasControlMagic(const std::string& path) {
  const UniqueFd fd(open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) return false;
  uint64_t magic = 0;
  return pread(fd.get(), &magic, sizeof(magic), 0) == sizeof(magic) && magic == kControlMagic;
}

json HolderJson(const PrefixHolder& holder) {
  return {{"pid", holder.pid ? json(*holder.pid) : json(nullptr)},
          {"host", holder.host},
          {"socket", holder.socket},
          {"state", holder.state}};
}

// Every tensorshm prefix in /dev/shm with files this user may judge (all, as root).
std::map<std::string, Found> Scan(const std::string& only_prefix) {
  std::map<std::string, Found> found;
  DIR* dir = opendir(kShmDir);
  if (dir == nullptr) return found;
  const uid_t euid = geteuid();
  while (dirent* entry = readdir(dir)) {
    bool lock = false;
    bool control = false;
    std::optional<std::string> prefix = PrefixOf(entry->d_name, &lock, &control);
    if (!prefix || (!only_prefix.empty() && *prefix != only_prefix)) continue;
    const std::string path = absl::StrCat(kShmDir, "/", entry->d_name);
    struct stat st;
    if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (euid != 0 && st.st_uid != euid) continue;
    Found& f = found[*prefix];
    f.objects[entry->d_name] = static_cast<uint64_t>(st.st_size);
    if (lock) f.lock_file = true;
    if (control && HasControlMagic(path)) f.control = true;
  }
  closedir(dir);
  // Names that only look like tensorshm's (no lock file, no control segment) are not judged.
  for (auto it = found.begin(); it != found.end();) {
    it = it->second.lock_file || it->second.control ? std::next(it) : found.erase(it);
  }
  return found;
}

}  // namespace

json LeftoversReport(const std::string& only_prefix, bool remove, bool* failed) {
  *failed = false;
  json leftovers = json::array();
  json live = json::array();
  for (auto& [prefix, found] : Scan(only_prefix)) {
    // Holding the prefix's lock while judging (and removing) keeps a daemon from starting on it
    // meanwhile; one starting now waits a moment for it (tensorshmd retries for a second).
    absl::StatusOr<PrefixLock> lock =
        PrefixLock::Take(prefix, /*create=*/remove, /*owner=*/std::nullopt);
    if (absl::IsUnavailable(lock.status())) {
      absl::StatusOr<PrefixHolder> holder = ReadPrefixHolder(prefix);
      live.push_back(
          {{"prefix", prefix}, {"holder", holder.ok() ? HolderJson(*holder) : json(nullptr)}});
      continue;
    }
    json entry = {{"prefix", prefix}, {"removed", false}, {"error", nullptr}};
    if (!lock.ok() && !absl::IsNotFound(lock.status())) {
      entry["error"] = std::string(lock.status().message());
      *failed = true;
    }
    const bool has_record = lock.ok() && (lock->previous().pid || !lock->previous().state.empty());
    entry["last_holder"] = has_record ? HolderJson(lock->previous()) : json(nullptr);
    entry["kept"] = has_record && lock->previous().state == "kept";
    // The lock file is the lock's own: it goes last, when the lock is released.
    const std::string lock_name = absl::StrCat(prefix, ".lock");
    json objects = json::array();
    uint64_t bytes = 0;
    for (const auto& [name, size] : found.objects) {
      objects.push_back({{"name", name}, {"bytes", size}});
      bytes += size;
    }
    entry["objects"] = std::move(objects);
    entry["bytes"] = bytes;
    if (lock.ok() && remove) {
      bool removed = true;
      for (const auto& [name, size] : found.objects) {
        if (name == lock_name) continue;
        const std::string path = absl::StrCat(kShmDir, "/", name);
        if (unlink(path.c_str()) != 0 && errno != ENOENT) {
          entry["error"] = absl::StrCat("unlink(", path, "): ", std::strerror(errno));
          removed = false;
          *failed = true;
        }
      }
      entry["removed"] = removed;
      if (!removed) lock->Keep();
    } else if (lock.ok()) {
      lock->Keep();  // only looked
    }
    leftovers.push_back(std::move(entry));
  }
  return {{"leftovers", std::move(leftovers)}, {"live", std::move(live)}};
}

std::string LeftoversText(const json& report, bool remove) {
  std::string out;
  if (report["leftovers"].empty()) {
    absl::StrAppend(&out,
                    "no leftovers: no tensorshm objects in /dev/shm that no live daemon holds\n");
  }
  for (const json& entry : report["leftovers"]) {
    const std::string prefix = entry["prefix"].get<std::string>();
    absl::StrAppend(&out, "/dev/shm/", prefix, ".*: ", entry["objects"].size(), " objects, ",
                    FormatBytes(entry["bytes"].get<int64_t>()));
    if (entry["last_holder"].is_null()) {
      absl::StrAppend(&out, ", holder not recorded");
    } else {
      const json& holder = entry["last_holder"];
      PrefixHolder h;
      if (!holder["pid"].is_null()) h.pid = holder["pid"].get<int64_t>();
      h.host = holder["host"].get<std::string>();
      h.socket = holder["socket"].get<std::string>();
      absl::StrAppend(&out, entry["kept"].get<bool>() ? ", kept by " : ", left by ",
                      DescribeHolder(h));
    }
    if (entry["removed"].get<bool>()) {
      absl::StrAppend(&out, ": removed\n");
    } else if (!entry["error"].is_null()) {
      absl::StrAppend(&out, ": not removed: ", entry["error"].get<std::string>(), "\n");
    } else {
      absl::StrAppend(&out,
                      entry["kept"].get<bool>()
                          ? " (--keep-segments: tensorshmd --shm-prefix " + prefix +
                                " serves its tensors again)\n"
                          : " (tensorshmd --shm-prefix " + prefix + " recovers its tensors)\n");
    }
    for (const json& object : entry["objects"]) {
      absl::StrAppend(&out, "  ", object["name"].get<std::string>(), "  ",
                      FormatBytes(object["bytes"].get<int64_t>()), "\n");
    }
  }
  for (const json& entry : report["live"]) {
    PrefixHolder h;
    const json& holder = entry["holder"];
    if (!holder.is_null()) {
      if (!holder["pid"].is_null()) h.pid = holder["pid"].get<int64_t>();
      h.host = holder["host"].get<std::string>();
      h.socket = holder["socket"].get<std::string>();
    }
    absl::StrAppend(&out, "/dev/shm/", entry["prefix"].get<std::string>(), ".*: in use by ",
                    DescribeHolder(h), ", left alone\n");
  }
  if (!remove && !report["leftovers"].empty()) {
    absl::StrAppend(&out, "tensorshmctl leftovers --remove [PREFIX] removes them\n");
  }
  return out;
}

}  // namespace tensorshm::ctl
