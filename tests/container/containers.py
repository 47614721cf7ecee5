"""The container tests' engine: buildah working containers of an image, commands and long-running
processes in them (`buildah run --isolation chroot`), as tests/container/container_test.py and
pods.py use them.

buildah's chroot isolation gives a container the host's /dev (so the /dev/shm of the test's mount
namespace) and no pid namespace: a container's process is signalled directly, as an engine
signals its pid 1 (buildah run itself does not pass signals on).
"""

import json
import os
import shlex
import signal
import subprocess
import time

# buildah with the test's store (tests/container/buildah-storage.sh exports it).
BUILDAH = shlex.split(os.environ.get("BUILDAH", ""))
RUN = ["run", "--isolation", "chroot", "--network", "host"]
CONSUMER = "/usr/local/bin/tensorshm_container_client"
CONTAINER_PREFIX = "tsm-test-container-"
# buildah's default capabilities (containers.conf). buildah 1.28 ignores --cap-add after
# --cap-drop ALL, so a securityContext's "drop ALL, add X" drops each of these but X.
DEFAULT_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "NET_BIND_SERVICE",
                "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"]
CAP_BITS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6,
            "SETUID": 7, "SETPCAP": 8, "NET_BIND_SERVICE": 10, "SYS_CHROOT": 18, "SETFCAP": 31}

_started = time.monotonic()


def step(message):
    print(f"[{time.monotonic() - _started:7.1f}s] {message}", flush=True)


class TestFailure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise TestFailure(message)
    step(f"ok: {message}")


def buildah(*args):
    """Runs buildah with the test's store; its stdout (TestFailure with stderr if it fails)."""
    result = subprocess.run(BUILDAH + list(args), capture_output=True, text=True)
    if result.returncode != 0:
        raise TestFailure(f"buildah {shlex.join(args)} exited {result.returncode}: "
                          f"{result.stderr.strip()}")
    return result.stdout


def without_buildah_noise(text):
    """Output less the lines buildah adds when the command exits non-zero."""
    return "\n".join(l for l in text.splitlines()
                     if not l.startswith(("subprocess exited ", "Error: exit status "))).strip()


def mount(*argv):
    subprocess.run(["mount"] + list(argv), check=True)


def unmount(target):
    subprocess.run(["umount", "-l", target], check=False)


class Container:
    """A working container of an image: `buildah from`, removed with remove()."""

    def __init__(self, image, name):
        self.name = CONTAINER_PREFIX + name
        buildah("from", "--pull=never", "--name", self.name, image)
        self.root = buildah("mount", self.name).strip()
        # buildah run mounts a volume of its own at each VOLUME of the image, and where the run
        # names a volume at the same path it mounts one of the two, which one varying from run
        # to run (buildah 1.28 sorts mounts by path, not stably). The test names the volumes at
        # those paths, as `docker run -v` or kubelet would: the container forgets the VOLUMEs.
        for volume in image_config(image).get("Volumes") or {}:
            buildah("config", "--volume", f"{volume}-", self.name)

    def path(self, path):
        """The host path of `path` inside the container (no symbolic link in it resolved)."""
        return os.path.join(self.root, path.lstrip("/"))

    def argv(self, argv, user=(0, 0), volumes=(), env=(), caps=None, no_new_privs=False):
        """`buildah run` of argv as user (uid, gid), with volumes (host path, container path,
        read-only), env (name, value), only the capabilities `caps` (None: buildah's defaults),
        and no_new_privs (allowPrivilegeEscalation: false; buildah's chroot isolation refuses
        no-new-privileges, so the image's own setpriv sets it before exec'ing argv)."""
        command = BUILDAH + RUN + ["--user", f"{user[0]}:{user[1]}"]
        for source, target, read_only in volumes:
            command += ["-v", f"{source}:{target}" + (":ro" if read_only else "")]
        for name, value in env:
            command += ["-e", f"{name}={value}"]
        if caps is not None:
            command += [f"--cap-drop=CAP_{c}" for c in DEFAULT_CAPS if c not in caps]
            command += [f"--cap-add=CAP_{c}" for c in caps if c not in DEFAULT_CAPS]
        command += [self.name, "--"]
        if no_new_privs:
            command += ["setpriv", "--no-new-privs", "--"]
        return command + list(argv)

    def run(self, argv, **options):
        """Runs argv in the container; (exit status, stdout and stderr together)."""
        result = subprocess.run(self.argv(argv, **options), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        return result.returncode, without_buildah_noise(result.stdout)

    def remove(self):
        subprocess.run(BUILDAH + ["rm", self.name], capture_output=True)


def children_by_parent():
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def program_of(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode()
    except OSError:
        return None


def container_processes(buildah_pid):
    """The processes a `buildah run` started in its container, the container's first process
    first: the children of buildah's buildah-chroot-exec helper, and theirs."""
    children = children_by_parent()
    found, queue = [], [buildah_pid]
    while queue:
        pid = queue.pop(0)
        if program_of(pid) == "buildah-chroot-exec":
            found += children.get(pid, [])
        queue += children.get(pid, [])
    return found


class Daemon:
    """A container's long-running process under `buildah run`, its output in a log file."""

    def __init__(self, container, argv, log_path, **options):
        self.log_path = log_path
        self.log = open(log_path, "w")
        step(f"start (uid {options.get('user', (0, 0))[0]}): {shlex.join(argv)}")
        self.process = subprocess.Popen(container.argv(argv, **options), stdout=self.log,
                                        stderr=subprocess.STDOUT)
        self.pid = None

    def output(self):
        with open(self.log_path) as f:
            return without_buildah_noise(f.read())

    def wait_serving(self, bound=60.0):
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if "serving on" in self.output():
                step("daemon: " + next(l for l in self.output().splitlines() if "serving on" in l))
                # The container's process (buildah runs it in the host's pid namespace): what
                # STOPSIGNAL goes to; buildah itself does not pass signals on.
                self.pid = container_processes(self.process.pid)[0]
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise TestFailure(f"tensorshmd did not start serving (exit {self.process.poll()}):\n"
                          + self.output())

    def stop(self, sig=signal.SIGTERM):
        """Sends sig to the container's process; its exit status."""
        if self.process.poll() is None:
            os.kill(self.pid, sig)
        rc = self.process.wait(timeout=60)
        self.log.close()
        return rc

    def kill(self):
        """SIGKILL to the container's processes, until buildah run exits (cleaning up after
        itself: killed first, it would leave them running)."""
        deadline = time.monotonic() + 10
        while self.process.poll() is None and time.monotonic() < deadline:
            for pid in container_processes(self.process.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if not self.log.closed:
            self.log.close()
        step("daemon output:\n" + self.output())


def private_tmpfs(target, options):
    """A fresh tmpfs at target, in the test's mount namespace only."""
    os.makedirs(target, exist_ok=True)
    mount("-t", "tmpfs", "-o", options, "tmpfs", target)


def image_config(image):
    """The Docker image configuration (HEALTHCHECK is Docker-only: built with --format docker)."""
    return json.loads(buildah("inspect", "--type", "image", image))["Docker"]["config"]


def user_ids(container, spec):
    """USER uid|name[:gid|group] -> (uid, gid), from the container's /etc/passwd and /etc/group."""
    user, _, group = spec.partition(":")
    with open(container.path("/etc/passwd")) as f:
        passwd = [l.split(":") for l in f if l.count(":") >= 6]
    entry = next((p for p in passwd if user in (p[0], p[2])), None)
    if entry is None and not user.isdigit():
        raise TestFailure(f"USER {spec}: no such user in the image")
    uid = int(entry[2]) if entry else int(user)
    gid = int(entry[3]) if entry else 0
    if group:
        with open(container.path("/etc/group")) as f:
            groups = {l.split(":")[0]: int(l.split(":")[2]) for l in f if l.count(":") >= 3}
        gid = int(group) if group.isdigit() else groups[group]
    return uid, gid


def with_client(image, build_image, name, work):
    """A working container of the image plus the test's client (tests/container/client, a
    find_package(tensorshm) user built in the build stage against an install of the same build
    tree): the image itself carries no client."""
    client = os.path.join(work, "tensorshm_container_client")
    if not os.path.exists(client):
        step("test client: tests/container/client built in the build stage against the "
             "installed package")
        build = Container(build_image, "build")
        try:
            script = ("cmake --install /build --prefix /opt/tsm-test-prefix >/dev/null && "
                      "cmake -S /src/tests/container/client -B /opt/tsm-consumer "
                      "-DCMAKE_PREFIX_PATH=/opt/tsm-test-prefix >/dev/null && "
                      "cmake --build /opt/tsm-consumer >/dev/null")
            rc, out = build.run(["/bin/sh", "-c", script])
            if rc != 0:
                raise TestFailure(f"the test client did not build (exit {rc}):\n{out}")
            subprocess.run(["cp", build.path("/opt/tsm-consumer/tensorshm_container_client"),
                            client], check=True)
        finally:
            build.remove()
    container = Container(image, name)
    buildah("copy", "--quiet", container.name, client, CONSUMER)
    return container


def exchange(container, producer, consumer, socket, name, server_uid=None, **options):
    """Publishes 1000 doubles as `producer` (uid, gid), acquires them as `consumer`; options as
    Container.argv's (their user is replaced)."""
    sums = []
    extra = [str(server_uid)] if server_uid is not None else []
    for verb, user in (("produce", producer), ("consume", consumer)):
        options["user"] = user
        rc, out = container.run([CONSUMER, verb, socket, name] + extra, **options)
        if rc != 0:
            raise TestFailure(f"{CONSUMER} {verb} {name} (uid {user[0]}) exited {rc}: {out}")
        sums.append(out)
        step(f"{verb} {name} as uid {user[0]}: sum {out}")
    check(sums[0] == sums[1] and sums[0] != "", f"{name}: the consumer read what the producer wrote")
