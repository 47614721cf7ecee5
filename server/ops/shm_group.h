// --shm-group: the one group given read-write access to the host pool's named segments, for a
// server that opens POSIX shm objects by name itself (Triton's system shared-memory extension
// opens them O_RDWR and maps them read-write, inputs included). Its members can read and write
// every byte of those segments: sealing and the daemon's uid checks no longer hold against them.
#ifndef TENSORSHM_SERVER_OPS_SHM_GROUP_H_
#define TENSORSHM_SERVER_OPS_SHM_GROUP_H_

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorshm {

struct ShmGroup {
  gid_t gid = 0;
  std::string name;  // the group's name, or its number where it has none
};

// Parses a --shm-group value as chgrp does: a group name, else a number, which is taken as a gid
// whether or not a group of that number is known here (a container may not know the host's
// groups). INVALID_ARGUMENT naming the flag and the value for a name no group has
// (`--shm-group = "nosuchgroup": no such group`) or a number that is no gid.
absl::StatusOr<ShmGroup> ParseShmGroup(absl::string_view text);

// The same for another flag's value (--allow-gid), named in the messages.
absl::StatusOr<ShmGroup> ParseGroup(absl::string_view flag, absl::string_view text);

// Whether this process can give the objects it creates to `group` (fchown): it runs with
// CAP_CHOWN (root, as a rule), or `group` is its effective gid or one of its supplementary
// groups. FAILED_PRECONDITION naming the flag, the group, the daemon's uid and the fix otherwise.
absl::Status CheckCanGiveToGroup(const ShmGroup& group);

// The name of group `gid`, or its number where no name is known: what --shm-group takes.
std::string GroupName(gid_t gid);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_OPS_SHM_GROUP_H_
