"""tensorshm.Daemon: a private tensorshmd this program starts and stops itself."""

from __future__ import annotations

import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

from ._client import Client, connect
from ._commands import installed_program
from ._errors import FailedPreconditionError, TimeoutError

# Every Daemon's shm prefix: tsmd-<pid of the Python process>-<random>; its directory:
# <tmp>/tensorshm-daemon-<pid>-<random>. A start removes those of processes that are gone.
_PREFIX = "tsmd-"
_DIR_PREFIX = "tensorshm-daemon-"


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reclaim_leftovers() -> None:
    """Removes the shm objects and directories of Daemons whose Python process is gone without
    stopping them (SIGKILL): their daemons ended with it (see Daemon), leaving no one to clean."""
    for path in pathlib.Path("/dev/shm").glob(f"{_PREFIX}*"):
        pid = path.name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                path.unlink()
            except OSError:
                pass  # another user's, or removed meanwhile
    for path in pathlib.Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*"):
        pid = path.name[len(_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


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
    leave it running, and the next Daemon start removes what it left in /dev/shm and the temp
    directory. Start it from a thread that outlives it (the main thread). Other processes reach
    it through ``socket`` (``tensorshm.connect(daemon.socket)``).
    """

    def __init__(self, host_pool: str = "1Gi", *, tensorshmd: str | None = None,
                 timeout: float = 10.0, **flags: Any) -> None:
        binary = _find_tensorshmd(tensorshmd)
        _reclaim_leftovers()
        tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.directory = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{tag}-")  # mode 0700
        self.socket = os.path.join(self.directory, "tensorshm.sock")
        self.prefix = f"{_PREFIX}{tag}"
        self.log_path = os.path.join(self.directory, "tensorshmd.log")
        for fixed in ("socket", "shm_prefix"):
            if fixed in flags:
                raise TypeError(f"Daemon: {fixed} is chosen by Daemon itself (it is private)")
        command = [binary, "--socket", self.socket, "--shm-prefix", self.prefix,
                   "--host-pool", str(host_pool), *_flag_args(flags)]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            command = [setpriv, "--pdeathsig", "TERM", "--", *command]
        with open(self.log_path, "wb") as log:
            self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            code = self._process.poll()
            if code is not None:
                self._process = None
                error = self.log().strip() or f"it exited {code}"
                shutil.rmtree(self.directory, ignore_errors=True)
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
        for path in pathlib.Path("/dev/shm").glob(f"{self.prefix}.*"):
            path.unlink(missing_ok=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        return code

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        if getattr(self, "_process", None) is not None:
            self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"tensorshm.Daemon(socket={self.socket!r}, {state})"
