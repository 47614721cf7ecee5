// Every flag tensorshmd takes, said once: --help and the --config file's keys both come from it.
#include <vector>

#include "common/base/socket_path.h"
#include "server/ops/options.h"

namespace tensorshm {

const std::vector<FlagSpec>& DaemonFlags() {
  // What each flag does is said once, here: --help and the --config keys both come from it.
  static const std::vector<FlagSpec> flags = {
      {"socket", FlagKind::kValue, "PATH",
       absl::StrCat("Unix socket to serve on (default: $TENSORSHM_SOCKET, else\n"
                    "$XDG_RUNTIME_DIR/tensorshm.sock, else\n"
                    "/tmp/tensorshm-$UID/tensorshm.sock; now ",
                    DefaultSocketPath(), ")")},
      {"host-pool", FlagKind::kValue, "SIZE",
       "most host memory the pool may hold (default 1Gi). Tensors\n"
       "adding up to 98% of it fit into an empty pool, whatever their\n"
       "sizes; after frees, free memory can be split into blocks\n"
       "smaller than the next tensor (fragmentation): `tensorshmctl\n"
       "status` shows the largest free block"},
      {"segment-size", FlagKind::kValue, "SIZE",
       "size of each shm segment the pool grows by (default 256Mi);\n"
       "a larger tensor gets a segment of its own size"},
      {"segments", FlagKind::kValue, "KIND",
       "shm: named objects in /dev/shm, recovered after a crash\n"
       "(default); memfd: anonymous memory, not bound by the size of\n"
       "/dev/shm, lost when the daemon dies (no recovery)"},
      {"shm-group", FlagKind::kValue, "GROUP",
       "make the host pool's /dev/shm segments mode 0660 with group\n"
       "GROUP (a name or gid), for servers that open them by name\n"
       "(Triton). Trade-off: every process in GROUP can read AND write\n"
       "every host tensor in them, published ones included (default:\n"
       "0600, the daemon's uid only). Needs root or a member of GROUP;\n"
       "not with --segments memfd"},
      {"shm-prefix", FlagKind::kValue, "P",
       "prefix of the shm object names (default: tsm-<random>); one\n"
       "daemon per prefix: a prefix a live daemon holds is refused"},
      {"max-tensors", FlagKind::kValue, "N", "tensor records in the catalog (default 4096)"},
      {"session-quota", FlagKind::kValue, "SIZE",
       "most bytes of unpublished buffers one session may hold at once\n"
       "(default 0: no limit beyond the pool)"},
      {"uid-sessions", FlagKind::kValue, "N",
       "most sessions (client connections) one uid may have open at\n"
       "once, over all its processes (default 1024; 0: no limit)"},
      {"uid-leases", FlagKind::kValue, "N",
       "most leases one uid may hold at once, through the daemon and\n"
       "in fast path lease slots (default 262144; 0: no limit)"},
      {"uid-waiters", FlagKind::kValue, "N",
       "most Acquire calls of one uid waiting in the daemon for a\n"
       "publish at once (default 32768; 0: no limit)"},
      {"uid-quota", FlagKind::kValue, "SIZE",
       "most bytes of unpublished buffers one uid may hold at once, over\n"
       "all its sessions; with a quota no buffers are stocked ahead\n"
       "(default 0: no limit beyond the pool)"},
      {"uid-connections", FlagKind::kValue, "N",
       "most connections one uid may have open on the socket at once;\n"
       "past it they are closed at accept (default 2 x --uid-sessions\n"
       "+ 64; 0: no limit). The daemon's own uid is not held to it"},
      {"uid-tensors", FlagKind::kValue, "N",
       "most tensor records (published tensors, empty ones included,\n"
       "and unpublished creates) one uid may hold at once (default: an\n"
       "even share of --max-tensors between the daemon's uid, each\n"
       "--allow-uid and each --allow-gid; 0: no limit)"},
      {"evict", FlagKind::kValue, "POLICY",
       "when a create finds its pool full: none (default: it fails, or\n"
       "waits if it asked to) or lru (first evict published tensors\n"
       "that nobody leases, least recently acquired first)"},
      {"log-level", FlagKind::kValue, "LEVEL", "debug, info, warning or error (default info)"},
      {"keep-segments", FlagKind::kSwitch, "",
       "on SIGTERM/SIGINT, leave the shm segments (and the catalog) for\n"
       "a later tensorshmd started with the same --shm-prefix"},
      {"recovery-grace", FlagKind::kValue, "S",
       "after recovering a killed daemon's segments, keep tensors that\n"
       "were unbound but leased this many seconds (default 10)"},
      {"allow-uid", FlagKind::kRepeated, "UID",
       "also admit clients running as UID (repeatable); by default only\n"
       "the daemon's own uid is admitted, others get PERMISSION_DENIED"},
      {"allow-gid", FlagKind::kRepeated, "GROUP",
       "also admit the members of GROUP, a name or a gid (repeatable):\n"
       "clients whose primary or supplementary group it is, as the\n"
       "kernel recorded them at connect\n"
       "(segments stay mode 0600 either way, unless --shm-group: clients\n"
       "receive their descriptors over the socket, and each uid writes\n"
       "only its own)"},
      {"cuda-pool", FlagKind::kRepeated, "cuda:N=SIZE",
       "a pool of SIZE bytes of device memory on CUDA device N\n"
       "(repeatable, one per device); needs the CUDA driver\n"
       "(libcuda.so.1, or $TENSORSHM_LIBCUDA)"},
      {"cuda-segment-size", FlagKind::kValue, "SIZE",
       "size of each segment a CUDA pool grows by, rounded up to\n"
       "the device's VMM granularity in a VMM pool\n"
       "(default: the pool's size, at most 1Gi)"},
      {"cuda-pool-kind", FlagKind::kValue, "KIND",
       "how CUDA pools allocate and share device memory: vmm\n"
       "(cuMemCreate, passed to clients as file descriptors over\n"
       "the memory channel, mapped read-only by consumers), ipc\n"
       "(cuMemAlloc with cudaIpcMemHandle, writable by every holder;\n"
       "what Triton's CUDA shared memory needs), or auto: vmm where\n"
       "the driver reports VMM with POSIX file descriptor handles,\n"
       "else ipc, logged at start (default: auto)"},
      {"metrics", FlagKind::kValue, "HOST:PORT",
       "serve Prometheus figures at http://HOST:PORT/metrics, e.g.\n"
       "127.0.0.1:9464 or [::1]:9464; port 0 takes a free port (logged)\n"
       "(default: off). Read-only and without tensor names, but a host\n"
       "beyond loopback exposes the figures to that network"},
  };
  return flags;
}

}  // namespace tensorshm
