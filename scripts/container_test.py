#!/usr/bin/env python3
"""`make test-container`: builds the Dockerfile for real in bookworm chroots (dockerfile_chroot)
and runs the image's daemon the way an engine would, then the Kubernetes manifests' containers.

Run by scripts/test-container.sh as root in a private mount namespace. Prints each step; exits 0
only if every check passed (checks whose interface is not merged yet say SKIP with the reason).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dockerfile_chroot as dc  # noqa: E402
from dockerfile_chroot import BuildError, Mounts, step  # noqa: E402

LOADER = "/lib64/ld-linux-x86-64.so.2"
# Where the Dockerfile's build stage keeps its CMake build tree (cmake -B /build).
BUILD_TREE = "/build"
CONSUMER_SOURCE = "/src/tests/install/consumer"
CONSUMER = "/usr/local/bin/tensorshm_consumer"
SKIPS = []


def skip(what, why):
    SKIPS.append(f"{what}: {why}")
    step(f"SKIP {what}: {why}")


def check(condition, message):
    if not condition:
        raise BuildError(message)
    step(f"ok: {message}")


class Daemon:
    """The image's daemon started in a root, as an engine would."""

    def __init__(self, root, argv, env, user, log_path, **spawn_args):
        self.root = root
        self.log_path = log_path
        self.log = open(log_path, "w")
        step(f"start (uid {user[0]}:{user[1]}): {' '.join(argv)}")
        self.process = dc.spawn(root, argv, env, user, stdout=self.log,
                                stderr=subprocess.STDOUT, **spawn_args)

    def output(self):
        with open(self.log_path) as f:
            return f.read()

    def wait_serving(self, bound=60.0):
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if "serving on" in self.output():
                step("daemon: " + next(l for l in self.output().splitlines() if "serving on" in l))
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise BuildError(f"tensorshmd did not start serving (exit {self.process.poll()}):\n"
                         + self.output())

    def stop(self, sig=signal.SIGTERM):
        if self.process.poll() is None:
            self.process.send_signal(sig)
        rc = self.process.wait()
        self.log.close()
        return rc

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if not self.log.closed:
            self.log.close()


def image_env(stage, home):
    env = {"PATH": dc.DEFAULT_PATH, "HOSTNAME": "tensorshm", "HOME": home}
    env.update(stage.env)
    return env


def list_libraries(root, binary):
    """The loader's --list (what ldd prints) of binary inside root: (text, missing libraries)."""
    result = subprocess.run(["chroot", root, LOADER, "--list", binary], capture_output=True,
                            text=True)
    missing = [l.strip() for l in result.stdout.splitlines() if "not found" in l]
    if result.returncode != 0 and not missing:
        raise BuildError(f"{LOADER} --list {binary}: {result.stderr.strip()}")
    return result.stdout, missing


def build_consumer(builder, build_stage, runtime):
    """The test's client (tests/install/consumer, a find_package(tensorshm) user), built in the
    build stage against an install of the same build tree and copied into a scratch copy of the
    runtime root only: the image itself carries no client."""
    step("test client: tests/install/consumer built in the build stage against the installed "
         "package")
    mounts = Mounts()
    try:
        mounts.container(build_stage.root)
        env = builder.run_env(build_stage, "/root")
        script = (f"cmake --install {BUILD_TREE} --prefix /opt/tsm-test-prefix >/dev/null && "
                  f"cmake -S {CONSUMER_SOURCE} -B /opt/tsm-consumer "
                  "-DCMAKE_PREFIX_PATH=/opt/tsm-test-prefix >/dev/null && "
                  "cmake --build /opt/tsm-consumer >/dev/null")
        dc.run_in(build_stage.root, ["/bin/sh", "-c", script], env)
    finally:
        mounts.unmount_all()
    target = os.path.join(runtime.root, CONSUMER.lstrip("/"))
    shutil.copy2(os.path.join(build_stage.root, "opt/tsm-consumer/tensorshm_consumer"), target)


def exchange(root, env, producer, consumer, socket, name):
    """Publishes 1000 doubles as `producer` (uid, gid), acquires them as `consumer`."""
    sums = []
    for verb, user in (("produce", producer), ("consume", consumer)):
        result = dc.spawn(root, [CONSUMER, verb, socket, name], env, user,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = result.communicate()
        if result.returncode != 0:
            raise BuildError(f"tensorshm_consumer {verb} {name} (uid {user[0]}) exited "
                             f"{result.returncode}: {err.strip()}")
        sums.append(out.strip())
        step(f"{verb} {name} as uid {user[0]}: sum {out.strip()}")
    check(sums[0] == sums[1] and sums[0] != "", f"{name}: the consumer read what the producer wrote")


def ctl(root, env, user, args):
    process = dc.spawn(root, ["/usr/local/bin/tensorshmctl"] + args, env, user,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = process.communicate()
    return process.returncode, out


def test_image(stage, work):
    """ENTRYPOINT + CMD as the image's USER, HEALTHCHECK, a tensor through it, SIGTERM."""
    config = stage.config
    root = stage.root
    uid, gid, home = dc.lookup_user(root, stage.user)
    step(f"image config: USER {stage.user} (uid {uid}), ENTRYPOINT {config['Entrypoint']}, "
         f"CMD {config['Cmd']}, VOLUME {config['Volumes']}, STOPSIGNAL {config['StopSignal']}, "
         f"HEALTHCHECK {config['Healthcheck'] and config['Healthcheck']['Test']}")
    check(uid != 0, f"the image runs as a non-root user (uid {uid})")
    socket = stage.env.get("TENSORSHM_SOCKET", "")
    check(os.path.dirname(socket) in config["Volumes"],
          f"TENSORSHM_SOCKET={socket} lies in a VOLUME")
    check(config["StopSignal"] == "SIGTERM", "STOPSIGNAL SIGTERM")
    check(config["Healthcheck"] is not None, "a HEALTHCHECK is declared")
    sock_dir = os.path.join(root, os.path.dirname(socket).lstrip("/"))
    st = os.stat(sock_dir)
    check(st.st_uid == uid and st.st_mode & 0o022 == 0,
          f"{os.path.dirname(socket)} belongs to uid {uid}, mode {oct(st.st_mode & 0o7777)}")

    for binary in ("/usr/local/bin/tensorshmd", "/usr/local/bin/tensorshmctl", CONSUMER):
        if not os.path.exists(os.path.join(root, binary.lstrip("/"))):
            skip(f"ldd {binary}", "tensorshmctl not built yet (not installed by this tree)")
            continue
        listing, missing = list_libraries(root, binary)
        print(listing.rstrip(), flush=True)
        check(not missing, f"every library of {binary} is in the runtime image")
    dev_packages = subprocess.run(["chroot", root, "dpkg-query", "-W", "-f", "${Package}\n"],
                                  capture_output=True, text=True, check=True).stdout.split()
    dev = [p for p in dev_packages if p.endswith("-dev") or p in ("gcc", "g++", "cmake")]
    check(not dev, "no compiler or -dev package in the runtime image")
    size = subprocess.run(["du", "-sh", "--exclude=./proc", root], capture_output=True,
                          text=True).stdout.split()[0]
    step(f"runtime root: {size} (bookworm-slim-like minbase plus the runtime packages)")

    has_ctl = os.path.exists(os.path.join(root, "usr/local/bin/tensorshmctl"))
    mounts = Mounts()
    daemon = None
    try:
        # A container's /dev/shm is 64 MiB unless --shm-size says otherwise.
        mounts.container(root, shm_size="64m")
        env = image_env(stage, home)
        argv = (config["Entrypoint"] or []) + (config["Cmd"] or [])
        daemon = Daemon(root, argv, env, (uid, gid), os.path.join(work, "image-daemon.log"))
        daemon.wait_serving()
        check(os.path.exists(os.path.join(root, socket.lstrip("/"))), f"{socket} exists")
        test = config["Healthcheck"]["Test"]
        if has_ctl:
            rc, out = ctl(root, env, (uid, gid), ["health"])
            step(f"HEALTHCHECK {' '.join(test)} -> exit {rc}: {out.strip()}")
            check(rc == 0, "the HEALTHCHECK command exits 0 while the daemon serves")
        else:
            skip("HEALTHCHECK " + " ".join(test), "tensorshmctl not built yet")
        exchange(root, env, (uid, gid), (uid, gid), socket, "container/image-test")
        if has_ctl:
            for args in (["ls"], ["ls", "-o", "json"], ["inspect", "container/image-test"]):
                rc, out = ctl(root, env, (uid, gid), args)
                step(f"tensorshmctl {' '.join(args)} -> exit {rc}:\n{out.rstrip()}")
                check(rc == 0 and "container/image-test" in out,
                      f"tensorshmctl {' '.join(args)} shows the published tensor")
        else:
            skip("tensorshmctl ls/inspect of the published tensor", "tensorshmctl not built yet")
        rc = daemon.stop(signal.SIGTERM)
        step("daemon output:\n" + daemon.output().rstrip())
        check(rc == 0, f"SIGTERM: tensorshmd exited {rc}")
        check(not os.path.exists(os.path.join(root, socket.lstrip("/"))),
              f"SIGTERM: {socket} removed")
        leftovers = os.listdir(os.path.join(root, "dev/shm"))
        check(not leftovers, f"SIGTERM: nothing left in the container's /dev/shm ({leftovers})")
        daemon = None
    finally:
        if daemon is not None:
            daemon.kill()
            step("daemon output:\n" + daemon.output().rstrip())
        mounts.unmount_all()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", default=".")
    parser.add_argument("--dockerfile", default="Dockerfile")
    parser.add_argument("--cache", default="/var/cache/tensorshm-test-container")
    parser.add_argument("--no-cache", action="store_true", help="run every step, cache nothing")
    parser.add_argument("--keep", action="store_true",
                        help="keep the stage roots on disk (printed) instead of in a tmpfs")
    parser.add_argument("--work-size", default="8g", help="size limit of the stage roots' tmpfs")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("test-container: needs root (debootstrap, chroot, mounts)", file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix="tsm-container.", dir=os.environ.get("TMPDIR", "/var/tmp"))
    started = time.monotonic()
    ok = False
    work_mount = Mounts()
    try:
        # The stage roots live in memory (they go with the private mount namespace): copying and
        # removing ~100k files on a shared disk is what would take longest otherwise.
        if not args.keep:
            work_mount.mount(["-t", "tmpfs", "-o", f"size={args.work_size},mode=0700", "tmpfs"],
                             work)
        builder = dc.Builder(args.dockerfile, args.context, args.cache, work,
                             use_cache=not args.no_cache)
        stages = builder.build()
        runtime = stages[-1]
        build_stage = next(s for s in stages if s.name == "build")
        build_consumer(builder, build_stage, runtime)
        test_image(runtime, work)
        ok = True
    except BuildError as e:
        print(f"test-container: FAILED: {e}", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            step(f"kept {work}")
        else:
            work_mount.unmount_all()
            shutil.rmtree(work, ignore_errors=True)
    for line in SKIPS:
        print(f"test-container: skipped: {line}")
    total = time.monotonic() - started
    print(f"test-container: {'passed' if ok else 'FAILED'} in {total:.0f} s"
          f"{f', {len(SKIPS)} skipped' if SKIPS else ''}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
