#include "server/ops/shm_group.h"

#include <grp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tensorshm {
namespace {

// The group named `name` (by name, or by gid when `gid` is set): its gid and name; nullopt if
// there is none; an error naming the lookup if the group database cannot be read.
absl::StatusOr<std::optional<ShmGroup>> LookUpGroup(const std::string& name,
                                                    std::optional<gid_t> gid) {
  const long hint = sysconf(_SC_GETGR_R_SIZE_MAX);
  std::vector<char> buffer(hint > 0 ? static_cast<size_t>(hint) : 4096);
  while (true) {
    struct group entry;
    struct group* found = nullptr;
    const int err = gid ? getgrgid_r(*gid, &entry, buffer.data(), buffer.size(), &found)
                        : getgrnam_r(name.c_str(), &entry, buffer.data(), buffer.size(), &found);
    if (err == ERANGE && buffer.size() < (1u << 20)) {
      buffer.resize(buffer.size() * 2);  // a group with many members
      continue;
    }
    // ENOENT and the like mean "no such group" for several NSS modules.
    if (err != 0 && err != ENOENT && err != ESRCH && err != EBADF && err != EPERM) {
      return absl::UnavailableError(absl::StrCat("cannot look up group ",
                                                 gid ? std::to_string(*gid) : "\"" + name + "\"",
                                                 ": ", std::strerror(err)));
    }
    if (found == nullptr) return std::nullopt;
    return ShmGroup{found->gr_gid, found->gr_name};
  }
}

// Whether this process's effective capabilities hold CAP_CHOWN (bit 0 of CapEff); where
// /proc cannot say, whether it is root.
bool HasCapChown() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    uint64_t capabilities = 0;
    if (absl::StartsWith(line, "CapEff:") &&
        absl::SimpleHexAtoi(absl::StripAsciiWhitespace(line.substr(7)), &capabilities)) {
      return (capabilities & 1) != 0;
    }
  }
  return geteuid() == 0;
}

bool IsMember(gid_t gid) {
  if (getegid() == gid) return true;
  const int count = getgroups(0, nullptr);
  if (count <= 0) return false;
  std::vector<gid_t> groups(static_cast<size_t>(count));
  const int got = getgroups(count, groups.data());
  for (int i = 0; i < got; ++i) {
    if (groups[i] == gid) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<ShmGroup> ParseShmGroup(absl::string_view text) {
  return ParseGroup("--shm-group", text);
}

absl::StatusOr<ShmGroup> ParseGroup(absl::string_view flag, absl::string_view text) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " = \"", text, "\": ", why));
  };
  if (text.empty()) return bad("expected a group name or a numeric gid");
  absl::StatusOr<std::optional<ShmGroup>> named = LookUpGroup(std::string(text), std::nullopt);
  if (!named.ok()) return bad(named.status().message());
  if (named->has_value()) return **named;
  uint32_t number = 0;
  if (!absl::ascii_isdigit(text[0]) || !absl::SimpleAtoi(text, &number)) {
    return bad("no such group");
  }
  // fchown takes (gid_t)-1 as "leave the group as it is".
  if (number == static_cast<uint32_t>(-1)) return bad("not a gid (4294967295 means none)");
  absl::StatusOr<std::optional<ShmGroup>> numbered = LookUpGroup("", number);
  if (numbered.ok() && numbered->has_value()) return **numbered;
  return ShmGroup{static_cast<gid_t>(number), std::string(text)};
}

absl::Status CheckCanGiveToGroup(const ShmGroup& group) {
  if (IsMember(group.gid) || HasCapChown()) return absl::OkStatus();
  const uid_t uid = geteuid();
  return absl::FailedPreconditionError(absl::StrCat(
      "--shm-group = \"", group.name, "\" (gid ", group.gid, "): tensorshmd runs as uid ", uid,
      ", which is neither a member of that group nor root (it lacks CAP_CHOWN), so it cannot give "
      "its segments to the group: add uid ",
      uid, " to the group (usermod -aG ", group.name,
      " <user>, then start tensorshmd in a new login session; systemd: SupplementaryGroups=), or "
      "run tensorshmd as root"));
}

std::string GroupName(gid_t gid) {
  absl::StatusOr<std::optional<ShmGroup>> found = LookUpGroup("", gid);
  if (found.ok() && found->has_value()) return (*found)->name;
  return std::to_string(gid);
}

}  // namespace tensorshm
