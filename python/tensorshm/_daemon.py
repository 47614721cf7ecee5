"""tensorshm.Daemon: a private tensorshmd this program starts and stops itself."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from typing import Any

from ._client import Client, connect
from ._commands import installed_program
from ._errors import FailedPreconditionError, TimeoutError

# Every Daemon has a tag, <pid of the Python process>-<8 random hex digits>; its shm prefix is
# tsmd-<tag> and its directory <tmp>/tensorshm-daemon-<tag>-<mkdtemp's suffix>, in which it holds
# an flock on owner.lock for its whole life. The pid is for people only: across pid namespaces
# (containers of one Pod sharing /dev/shm and /tmp) it says nothing about who is alive.
_PREFIX = "tsmd-"
_DIR_PREFIX = "tensorshm-daemon-"
_TAG = re.compile(r"[0-9]+-[0-9a-f]{8}")
_OWNER_LOCK = "owner.lock"
_SHM = pathlib.Path("/dev/shm")
# The most of a prefix's lock file read to see whether a tensorshmd recorded itself in it.
_MAX_LOCK_RECORD = 4096


def _find_tensorshmd(explicit: str | None) -> str:
    """The tensorshmd to run: `explicit`, $TENSORSHMD, the one installed with this package (the
    wheel's), or the first on PATH."""
    candidates = [explicit, os.environ.get("TENSORSHMD"),
                  str(installed_program("tensorshmd")),
                  shutil.which("tensorshmd")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "tensorshmd not found: not given (tensorshmd=...), not in $TENSORSHMD, not installed with "
        "this package, not on PATH: install tensorshm's wheel or Debian package, or build it "
        "(make build)"
    )


class _NotProvablyDead(Exception):
    """A Daemon's leftovers that may still be in use: left alone."""


def _take_lock(name: str, held: contextlib.ExitStack, dir_fd: int | None = None) -> int | None:
    """Takes an exclusive flock on the file `name` (relative to `dir_fd`), without following a
    link and without waiting, held until `held` closes. Returns its descriptor, or None if there
    is no such file. Raises _NotProvablyDead if another process holds the lock, or if the file is
    not a regular file of this user."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _NotProvablyDead(name) from e
    held.callback(os.close, fd)
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode) or opened.st_uid != os.geteuid():
        raise _NotProvablyDead(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        raise _NotProvablyDead(name) from e
    return fd


def _hold_owner_lock(directory: str) -> int:
    """Creates `directory`/owner.lock already locked: made under another name, locked, then
    renamed, so that no reclaimer ever finds it there unlocked while this Daemon lives. Returns
    the descriptor (close-on-exec) that holds the lock."""
    staging = os.path.join(directory, _OWNER_LOCK + ".new")
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it open
        os.rename(staging, os.path.join(directory, _OWNER_LOCK))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reclaim(tag: str, directories: list[pathlib.Path], names: list[str]) -> None:
    """Removes one Daemon's `directories` and /dev/shm `names` if it is provably dead (see
    _reclaim_leftovers); raises _NotProvablyDead, removing nothing, if not."""
    euid = os.geteuid()
    with contextlib.ExitStack() as held:
        for directory in directories:
            try:
                dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW |
                                 os.O_CLOEXEC)
            except OSError as e:
                raise _NotProvablyDead(str(directory)) from e
            held.callback(os.close, dir_fd)
            if os.fstat(dir_fd).st_uid != euid or _take_lock(_OWNER_LOCK, held, dir_fd) is None:
                raise _NotProvablyDead(str(directory))
        lock_name = f"{_PREFIX}{tag}.lock"
        prefix_lock = _take_lock(str(_SHM / lock_name), held)
        if not directories and (prefix_lock is None or not any(
                line.startswith((b"pid ", b"state "))
                for line in os.pread(prefix_lock, _MAX_LOCK_RECORD, 0).splitlines())):
            raise _NotProvablyDead(lock_name)
        for name in sorted(names, key=lambda name: name == lock_name):  # the lock file last
            path = _SHM / name
            with contextlib.suppress(OSError):  # removed meanwhile
                if path.lstat().st_uid == euid:
                    path.unlink()
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


def _reclaim_leftovers() -> None:
    """Removes what Daemons that are provably dead left in /dev/shm and the temp directory: a
    Daemon whose Python process was killed (SIGKILL) leaves its directory, and its tensorshmd
    what it had not removed when it was killed, with no one left to clean.

    A Daemon is provably dead when this process takes, without waiting, the locks its processes
    held for their whole lives; the pid in its names is not looked at, as it means nothing in
    another pid namespace. Its Python process holds the flock on <directory>/owner.lock, and hands
    it on to its tensorshmd (one lock, held while either lives); the file is made already locked
    (see _hold_owner_lock), so a free lock is one whose holders are gone. Its tensorshmd holds
    the flock on /dev/shm/<prefix>.lock (common/base/prefix_lock.h), which records it after it is
    taken. For each Daemon tag (the directories and /dev/shm names carrying it):

    - Every directory of it must be a directory (not a link) of this user with an owner.lock
      this process locks. A directory without owner.lock is left: its Daemon may be between
      making it and its lock (or have died there, or be an older tensorshm's, which made none).
    - Its prefix lock file, if there is one, must be a regular file of this user that this
      process locks. With a directory, a missing one is no sign of life: the owner lock just
      taken outlived the tensorshmd, the only process that makes the tag's /dev/shm names.
    - Without a directory (another container's temp directory, or removed), the prefix lock
      file alone must prove it: it must exist and hold a tensorshmd's record, since a file with
      none may be one a starting tensorshmd made and has not locked yet. /dev/shm names without
      a lock file are left: with nothing that says whose they are, they may be a live daemon's.

    Then this user's names in /dev/shm go (the lock file last), then the directories. Another
    user's files, links and names that a Daemon does not make are never touched."""
    directories: dict[str, list[pathlib.Path]] = {}
    for path in pathlib.Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*"):
        tag = path.name[len(_DIR_PREFIX):].rpartition("-")[0]
        if _TAG.fullmatch(tag):
            directories.setdefault(tag, []).append(path)
    names: dict[str, list[str]] = {}
    for path in _SHM.glob(f"{_PREFIX}*"):
        tag, dot, _ = path.name[len(_PREFIX):].partition(".")
        if dot and _TAG.fullmatch(tag):
            names.setdefault(tag, []).append(path.name)
    for tag in sorted(directories.keys() | names.keys()):
        with contextlib.suppress(_NotProvablyDead):
            _reclaim(tag, directories.get(tag, []), names.get(tag, []))


def _flag_args(flags: dict[str, Any]) -> list[str]:
    """tensorshmd arguments from keyword arguments: host_pool="1Gi" -> --host-pool 1Gi; True ->
    a switch; a list or tuple -> the flag once per item (allow_uid=[1000, 1001]); None -> left
    out."""
    args: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                args += [flag, str(item)]
        else:
            args += [flag, str(value)]
    return args


class Daemon:
    """A private tensorshmd for this program: on a socket in a new 0700 directory, with its own
    shm prefix, stopped (SIGTERM: its segments are removed) when the ``with`` block ends, on
    ``stop()``, or when this Python process exits.

        with tensorshm.Daemon(host_pool="1Gi") as daemon, daemon.connect() as client:
            client.put("x", np.arange(10))

    Keyword arguments are tensorshmd's flags (``tensorshmd --help``), underscores for dashes:
    ``Daemon(host_pool="4Gi", segments="memfd", allow_uid=[1000])``; ``True`` passes a switch.
    ``tensorshmd``: the program (default: $TENSORSHMD, the one installed with this package, or
    the first on PATH). ``timeout``: how long to wait for it to serve. A daemon that cannot start
    raises FailedPreconditionError with its own error.

    The daemon is told when the thread that started it ends (the kernel's parent-death signal,
    through util-linux's setpriv where installed): a Python process killed with SIGKILL does not
    leave it running, and the next Daemon start (in any process of this user sharing /dev/shm
    and the temp directory, in any pid namespace) removes what it left in /dev/shm and the temp
    directory, once its tensorshmd is gone too; it removes nothing of a Daemon whose processes
    may live (see _reclaim_leftovers). Start it from a thread that outlives it (the main
    thread). Other processes reach it through ``socket`` (``tensorshm.connect(daemon.socket)``).
    """

    def __init__(self, host_pool: str = "1Gi", *, tensorshmd: str | None = None,
                 timeout: float = 10.0, **flags: Any) -> None:
        for fixed in ("socket", "shm_prefix"):
            if fixed in flags:
                raise TypeError(f"Daemon: {fixed} is chosen by Daemon itself (it is private)")
        binary = _find_tensorshmd(tensorshmd)
        self._process: subprocess.Popen[bytes] | None = None
        _reclaim_leftovers()
        tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.directory = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{tag}-")  # mode 0700
        try:
            owner_lock = _hold_owner_lock(self.directory)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._owner_lock: int | None = owner_lock
        self.socket = os.path.join(self.directory, "tensorshm.sock")
        self.prefix = f"{_PREFIX}{tag}"
        self.log_path = os.path.join(self.directory, "tensorshmd.log")
        command = [binary, "--socket", self.socket, "--shm-prefix", self.prefix,
                   "--host-pool", str(host_pool), *_flag_args(flags)]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            command = [setpriv, "--pdeathsig", "TERM", "--", *command]
        # tensorshmd shares the owner lock (one open file), so that it is free only when both
        # are gone: a tensorshmd that outlives this process (no setpriv) keeps its directory.
        try:
            with open(self.log_path, "wb") as log:
                self._process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    pass_fds=(owner_lock,))
        except BaseException:
            self._remove_directory()
            raise
        deadline = time.monotonic() + timeout
        while True:
            code = self._process.poll()
            if code is not None:
                self._process = None
                error = self.log().strip() or f"it exited {code}"
                self._remove_directory()
                raise FailedPreconditionError(f"tensorshmd did not start: {error}")
            if os.path.exists(self.socket):
                try:
                    connect(self.socket, client_name="tensorshm.Daemon", timeout=1.0).close()
                    break
                except ConnectionError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"tensorshmd did not serve {self.socket} within {timeout} s")
            time.sleep(0.01)

    @property
    def pid(self) -> int | None:
        """The daemon's process id (of setpriv, which became tensorshmd), None once stopped."""
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def connect(self, **kwargs: Any) -> Client:
        """A client of this daemon (tensorshm.connect's keyword arguments)."""
        return connect(self.socket, **kwargs)

    def log(self) -> str:
        """What the daemon has written to its log so far."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        """Stops the daemon (SIGTERM; SIGKILL after `timeout` s) and removes its directory and
        whatever it left in /dev/shm. Returns its exit code (None if already stopped)."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
        for path in _SHM.glob(f"{self.prefix}.*"):
            path.unlink(missing_ok=True)
        self._remove_directory()
        return code

    def _remove_directory(self) -> None:
        """Removes the directory, then lets go of its owner lock: a reclaimer that takes the lock
        finds the directory gone or going."""
        shutil.rmtree(self.directory, ignore_errors=True)
        owner_lock, self._owner_lock = self._owner_lock, None
        if owner_lock is not None:
            os.close(owner_lock)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        if (getattr(self, "_process", None) is not None or
                getattr(self, "_owner_lock", None) is not None):
            self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"tensorshm.Daemon(socket={self.socket!r}, {state})"
