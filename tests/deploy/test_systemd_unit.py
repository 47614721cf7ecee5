"""deploy/systemd/tensorshmd.service's hardening: its `systemd-analyze security` score, and
tensorshmd serving clients under the restrictions of the unit that can break it.

This machine's PID 1 is not systemd, so neither `systemctl start` nor `systemd-run` can run the
unit. The tests here apply those restrictions themselves, in the daemon's process between fork
and exec, the seccomp filters last as systemd loads them:

- ProtectProc= and ProcSubset= (as root only): /proc mounted again with hidepid= and subset= in
  a mount namespace of the daemon's own;
- User= (as root only): an unprivileged uid, which leaves the daemon without capabilities, as
  CapabilityBoundingSet= does;
- UMask=;
- RestrictAddressFamilies= and MemoryDenyWriteExecute=: the seccomp rules systemd makes of them;
- SystemCallFilter= last, as systemd loads it: the unit's lines expanded with
  `systemd-analyze syscall-filter` (the groups as this systemd defines them) and merged as systemd
  merges them (an allow list starts from @default, `~` takes away), loaded with libseccomp
  (systemd's library, installed with it) with systemd's action: SIGSYS kills the process at the
  first call outside the list (SystemCallErrorNumber= would say otherwise). Loading a filter sets
  no_new_privs, as NoNewPrivileges= does.

Not applied: the other namespaces and mounts (ProtectSystem=, PrivateDevices=, PrivateTmp=, ...),
IPAddressDeny= (a cgroup BPF program) and the other settings systemd makes seccomp rules of
(RestrictNamespaces=, LockPersonality=, RestrictRealtime=, RestrictSUIDSGID=).
"""

import ctypes
import errno
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest

from test_manifests import UNIT, daemon_binary, shipped_config, unit_entries

# What issue 35 asked of the unit: `systemd-analyze security` scores it 2.0 or lower.
MAX_EXPOSURE = 2.0
# The unprivileged user the daemon runs as under test as root (User=tensorshm in the unit).
NOBODY = 65534

# libseccomp's actions (seccomp.h) and argument comparisons (enum scmp_compare).
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_LT, SCMP_CMP_EQ, SCMP_CMP_GT, SCMP_CMP_MASKED_EQ = 2, 4, 6, 7
PROT_WRITE, PROT_EXEC, SHM_EXEC = 0x2, 0x4, 0o100000
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000


def scmp_act_errno(number):
    return 0x00050000 | (number & 0xFFFF)


def systemd_analyze():
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd; scripts/setup.sh "
                    "does)")
    return analyze


def service_lines(key):
    """The unit's [Service] values of `key`, in order."""
    return unit_entries(UNIT).get(("Service", key), [])


def service_value(key):
    lines = service_lines(key)
    return lines[-1] if lines else None


# ---------------------------------------------------------------- the score


def test_systemd_unit_security_exposure_is_at_most_2():
    result = subprocess.run([systemd_analyze(), "security", "--offline=true", "--no-pager", UNIT],
                            capture_output=True, text=True)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert found, f"no overall exposure in:\n{result.stdout}{result.stderr}"
    exposure = float(found.group(1))
    print(f"systemd-analyze security --offline: {UNIT}: {exposure}")
    open_items = "\n".join(l for l in result.stdout.splitlines() if l.startswith("✗"))
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}:\n{open_items}"


# ---------------------------------------------------------------- the filters, as systemd's


def syscall_groups(analyze):
    """{"@group": [member, ...]} as `systemd-analyze syscall-filter` prints them (members are
    system calls or other groups)."""
    listing = subprocess.run([analyze, "syscall-filter", "--no-pager"], capture_output=True,
                             text=True, check=True).stdout
    groups = {}
    members = None
    for line in listing.splitlines():
        if line.startswith("@"):
            members = groups.setdefault(line.split()[0], [])
        elif not line.strip():
            members = None
        elif members is not None and line.startswith(" ") and not line.strip().startswith("#"):
            members.append(line.split()[0])
    assert "@system-service" in groups and "@default" in groups, listing[:2000]
    return groups


def expand(names, groups):
    calls = set()
    for name in names:
        if name.startswith("@"):
            assert name in groups, f"SystemCallFilter=: no group {name} in this systemd"
            calls |= expand(groups[name], groups)
        else:
            calls.add(name)
    return calls


def allowed_syscalls(analyze):
    """The unit's SystemCallFilter= lines merged as systemd does: the first line, not inverted,
    makes an allow list that starts from @default; later lines add, `~` lines take away."""
    groups = syscall_groups(analyze)
    allowed = None
    for line in service_lines("SystemCallFilter"):
        if not line:
            allowed = None  # an empty assignment resets the filter
            continue
        invert = line.startswith("~")
        calls = expand(line.lstrip("~").split(), groups)
        if allowed is None:
            assert not invert, f"SystemCallFilter={line}: the unit's filter must be an allow list"
            allowed = expand(["@default"], groups)
        allowed = allowed - calls if invert else allowed | calls
    assert allowed, "the unit has no SystemCallFilter="
    return allowed


def denied_action():
    """systemd's action for a call outside the allow list: SIGSYS kills the process, unless
    SystemCallErrorNumber= names an errno."""
    number = service_value("SystemCallErrorNumber")
    if number in (None, "", "kill"):
        return SCMP_ACT_KILL_PROCESS
    return scmp_act_errno(int(number) if number.isdigit() else getattr(errno, number))


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class Seccomp:
    """The libseccomp systemd uses, through ctypes."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
        except OSError:
            pytest.skip("libseccomp2 is not installed (libseccomp.so.2: Debian's libseccomp2, "
                        "which systemd depends on; scripts/setup.sh installs systemd)")
        self.lib.seccomp_init.restype = ctypes.c_void_p
        self.lib.seccomp_init.argtypes = [ctypes.c_uint32]
        self.lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        self.lib.seccomp_rule_add_exact_array.argtypes = [
            ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(ArgCmp)]
        self.lib.seccomp_load.argtypes = [ctypes.c_void_p]

    def filter(self, default_action, rules):
        """A filter context: `rules` are (action, system call name, [(arg, op, a, b), ...]).
        Names this architecture lacks are left out, as systemd leaves them out."""
        context = self.lib.seccomp_init(default_action)
        assert context, "seccomp_init failed"
        for action, name, comparisons in rules:
            number = self.lib.seccomp_syscall_resolve_name(name.encode())
            if number == -1:  # __NR_SCMP_ERROR: unknown to this libseccomp
                continue
            array = (ArgCmp * max(1, len(comparisons)))(*[ArgCmp(*c) for c in comparisons])
            result = self.lib.seccomp_rule_add_exact_array(context, action, number,
                                                           len(comparisons), array)
            # -EDOM: a call of another architecture; systemd ignores it too.
            assert result in (0, -errno.EDOM), f"seccomp rule for {name}: {os.strerror(-result)}"
        return context

    def load(self, context):
        result = self.lib.seccomp_load(context)
        if result != 0:
            raise OSError(-result, "seccomp_load")


def unit_filters(seccomp, analyze):
    """The unit's seccomp filters, in the order systemd loads them (the system call filter last:
    after it, loading another would need seccomp(2), which it does not allow)."""
    filters = []
    families = sorted(getattr(socket, name) for name in
                      service_value("RestrictAddressFamilies").split())
    assert families, "RestrictAddressFamilies= must be an allow list"
    refuse = scmp_act_errno(errno.EAFNOSUPPORT)
    rules = [(refuse, "socket", [(0, SCMP_CMP_LT, families[0], 0)]),
             (refuse, "socket", [(0, SCMP_CMP_GT, families[-1], 0)])]
    rules += [(refuse, "socket", [(0, SCMP_CMP_EQ, family, 0)])
              for family in range(families[0] + 1, families[-1]) if family not in families]
    filters.append(seccomp.filter(SCMP_ACT_ALLOW, rules))
    if service_value("MemoryDenyWriteExecute") == "yes":
        eperm = scmp_act_errno(errno.EPERM)
        write_exec = PROT_WRITE | PROT_EXEC
        filters.append(seccomp.filter(SCMP_ACT_ALLOW, [
            (eperm, "mmap", [(2, SCMP_CMP_MASKED_EQ, write_exec, write_exec)]),
            (eperm, "mprotect", [(2, SCMP_CMP_MASKED_EQ, PROT_EXEC, PROT_EXEC)]),
            (eperm, "pkey_mprotect", [(2, SCMP_CMP_MASKED_EQ, PROT_EXEC, PROT_EXEC)]),
            (eperm, "shmat", [(2, SCMP_CMP_MASKED_EQ, SHM_EXEC, SHM_EXEC)])]))
    filters.append(seccomp.filter(
        denied_action(),
        [(SCMP_ACT_ALLOW, name, []) for name in sorted(allowed_syscalls(analyze))]))
    return filters


def proc_mount_options():
    """ProtectProc= and ProcSubset= as the mount options systemd gives /proc."""
    options = []
    if service_value("ProtectProc") not in (None, "default"):
        options.append(f"hidepid={service_value('ProtectProc')}")
    if service_value("ProcSubset") not in (None, "all"):
        options.append(f"subset={service_value('ProcSubset')}")
    return ",".join(options)


def enter_unit(seccomp, filters, proc_options, user):
    """A preexec_fn: the unit's /proc, user and seccomp filters, in systemd's order."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result, what):
        if result != 0:
            raise OSError(ctypes.get_errno(), what)

    def enter():
        if proc_options:
            check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount(/, private)")
            check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                             proc_options.encode()), f"mount(/proc, {proc_options})")
        # A soft open file limit below the hard one, so that the daemon raises it under the
        # filter (the unit's LimitNOFILE= sets both: nothing to raise there).
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        if user is not None:
            os.setgroups([])
            os.setresgid(user, user, user)
            os.setresuid(user, user, user)
        for context in filters:
            seccomp.load(context)

    return enter


# ---------------------------------------------------------------- serving a client

PUT_AND_GET = """
import sys
import numpy as np
import tensorshm
socket, server_uid, role = sys.argv[1], int(sys.argv[2]), sys.argv[3]
expected = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
with tensorshm.connect(socket, client_name="unit-" + role, server_uid=server_uid) as client:
    if role == "put":
        client.put("unit/x", expected)
    else:
        got = tensorshm.to_numpy(client.get("unit/x"))
        assert (got == expected).all(), got
        print("got unit/x", got.shape, got.dtype)
"""


class UnitDaemon:
    """tensorshmd with the unit's ExecStart arguments (its config file from deploy/systemd, a
    socket and shm prefix of its own, a small pool, metrics on a free loopback port), started
    under the unit's restrictions."""

    def __init__(self, user, shm_group, extra_args=()):
        analyze = systemd_analyze()
        seccomp = Seccomp()
        self.server_uid = os.geteuid() if user is None else user
        self.base = tempfile.mkdtemp(prefix="tsm-unit-")
        os.chmod(self.base, 0o711)
        # RuntimeDirectory=, RuntimeDirectoryMode=0711: made for the daemon's user.
        runtime = os.path.join(self.base, "tensorshm")
        os.mkdir(runtime, 0o711)
        os.chown(runtime, self.server_uid, -1)
        self.socket = os.path.join(runtime, "tensorshm.sock")
        self.prefix = f"tsm-unit-{os.getpid()}-{'root' if user is not None else 'self'}"
        self.remove_segments()
        args = service_value("ExecStart").split()[1:]
        args[args.index("--config") + 1] = shipped_config(self.base)
        args[args.index("--socket") + 1] = self.socket
        args[args.index("--shm-prefix") + 1] = self.prefix
        args += ["--host-pool", "64Mi", "--segment-size", "16Mi", "--metrics", "127.0.0.1:0",
                 "--shm-group", str(shm_group), *extra_args]
        self.log_path = os.path.join(self.base, "tensorshmd.log")
        umask = int(service_value("UMask"), 8)
        proc_options = proc_mount_options() if user is not None else ""
        filters = unit_filters(seccomp, analyze)
        self.filters = len(filters)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [daemon_binary(), *args], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, umask=umask,
                preexec_fn=enter_unit(seccomp, filters, proc_options, user))
        self.ctl = os.path.join(os.path.dirname(daemon_binary()), "tensorshmctl")
        print(f"tensorshmd {' '.join(args)}: uid {self.server_uid}, umask {umask:04o}, "
              f"/proc {proc_options or 'as it is'}")

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def tensorshmctl(self, *args):
        return subprocess.run([self.ctl, "--socket", self.socket, "--timeout", "5s",
                               "--server-uid", str(self.server_uid), *args],
                              capture_output=True, text=True, timeout=30)

    def wait_serving(self, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, (
                f"tensorshmd exited {self.process.returncode} "
                f"({describe_exit(self.process.returncode)}):\n{self.log()}")
            if os.path.exists(self.socket) and self.tensorshmctl("health").returncode == 0:
                return
            assert time.monotonic() < deadline, f"tensorshmd did not serve:\n{self.log()}"
            time.sleep(0.1)

    def metrics_port(self):
        found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", self.log())
        assert found, self.log()
        return int(found.group(1))

    def segments(self):
        return [os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")
                if n.startswith(self.prefix + ".")]

    def remove_segments(self):
        # --keep-segments (the unit's): a stopped daemon leaves its segments and catalog.
        for path in self.segments():
            os.unlink(path)

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def close(self):
        self.stop()
        self.remove_segments()
        shutil.rmtree(self.base, ignore_errors=True)


def describe_exit(code):
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        if -code == signal.SIGSYS:
            return f"{name}: a system call outside the unit's SystemCallFilter="
        return name
    return f"status {code}"


class Served(NamedTuple):
    socket_mode: int
    segment_modes: dict  # /dev/shm name -> mode
    proc_options: str  # the mount options of the /proc the daemon sees


def serve_a_client(daemon):
    """Health, a tensor put by one client process and read by another, the metrics endpoint,
    the kernel's view of the daemon (its filters, no_new_privs), a clean SIGTERM stop. Returns
    the modes the daemon gave its files under the unit's umask and its /proc's options."""
    daemon.wait_serving()
    health = daemon.tensorshmctl("health")
    print("tensorshmctl health:", health.returncode, health.stdout.strip(), health.stderr.strip())
    assert health.returncode == 0, health.stderr
    for role in ("put", "get"):
        client = subprocess.run([sys.executable, "-c", PUT_AND_GET, daemon.socket,
                                 str(daemon.server_uid), role],
                                capture_output=True, text=True, timeout=60)
        print(f"python {role}:", client.returncode, client.stdout.strip())
        assert client.returncode == 0, f"{client.stderr}\ndaemon:\n{daemon.log()}"
    listed = daemon.tensorshmctl("-o", "json", "ls")
    assert listed.returncode == 0, listed.stderr
    assert "unit/x" in listed.stdout, listed.stdout
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port()}/metrics",
                                timeout=10) as response:
        metrics = response.read().decode()
    assert response.status == 200 and "tensorshm" in metrics, metrics[:500]
    # What the kernel says of the daemon: its filters loaded, no_new_privs, its umask.
    proc = Path("/proc", str(daemon.process.pid))
    status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
    print("daemon's /proc status:", {k: status[k].strip() for k in
          ("Uid", "Umask", "CapEff", "NoNewPrivs", "Seccomp", "Seccomp_filters")})
    assert status["Seccomp"].strip() == "2"  # SECCOMP_MODE_FILTER
    assert int(status["Seccomp_filters"]) == daemon.filters
    assert status["NoNewPrivs"].strip() == "1"
    # The options of the last /proc mount: the one on top, which the daemon sees.
    proc_options = [line.split(" - ")[1].split()[-1]
                    for line in (proc / "mountinfo").read_text().splitlines()
                    if line.split()[4] == "/proc"][-1]
    print("daemon's /proc mount options:", proc_options)
    socket_mode = stat.S_IMODE(os.stat(daemon.socket).st_mode)
    modes = {os.path.basename(p): stat.S_IMODE(os.stat(p).st_mode) for p in daemon.segments()}
    print(f"socket {socket_mode:04o}; /dev/shm: " +
          ", ".join(f"{n} {m:04o}" for n, m in sorted(modes.items())))
    code = daemon.stop()
    assert code == 0, f"tensorshmd exited {describe_exit(code)} on SIGTERM:\n{daemon.log()}"
    return Served(socket_mode, modes, proc_options)


@pytest.fixture
def unit_daemon():
    started = []

    def start(**kwargs):
        started.append(UnitDaemon(**kwargs))
        return started[-1]

    yield start
    for daemon in started:
        daemon.close()


def require_tensorshm():
    found = subprocess.run([sys.executable, "-c", "import tensorshm, numpy"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip("tensorshm is not installed (in this Python: make python)")


def test_systemd_unit_filters_serve_a_client(unit_daemon):
    """As this user: the unit's seccomp filters (SystemCallFilter=, RestrictAddressFamilies=,
    MemoryDenyWriteExecute=) and UMask=; --shm-group of this user's own group has the daemon
    fchown and fchmod every segment."""
    require_tensorshm()
    daemon = unit_daemon(user=None, shm_group=os.getegid())
    served = serve_a_client(daemon)
    # The shipped config admits a group (allow-gid): the credentials decide, not the file's mode.
    assert served.socket_mode == 0o666
    assert 0o660 in served.segment_modes.values(), \
        f"no group-shared segment under UMask={service_value('UMask')}: {served.segment_modes}"


def test_systemd_unit_serves_another_user_as_its_own_user(unit_daemon):
    """As root: the daemon also runs as an unprivileged uid (User=) with /proc as ProtectProc=
    and ProcSubset= make it, and serves root's clients, admitted with allow-uid."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts /proc in a mount namespace and runs the daemon as "
                    f"uid {NOBODY}")
    require_tensorshm()
    daemon = unit_daemon(user=NOBODY, shm_group=NOBODY, extra_args=("--allow-uid", "0"))
    served = serve_a_client(daemon)
    assert served.socket_mode == 0o666  # allow-gid, allow-uid: the credentials decide
    assert 0o660 in served.segment_modes.values(), served.segment_modes
    segments = daemon.segments()
    assert segments and all(os.stat(p).st_uid == NOBODY for p in segments), segments
    wanted = set(proc_mount_options().split(","))
    assert wanted <= set(served.proc_options.split(",")), served.proc_options
