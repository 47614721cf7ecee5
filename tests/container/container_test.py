#!/usr/bin/env python3
"""`make test-container`: the image buildah built from the Dockerfile, run the way an engine would
(ENTRYPOINT + CMD as its USER, the HEALTHCHECK command, STOPSIGNAL, a client), then the
Kubernetes manifests' containers the way kubelet would (pods.py).

Run by tests/container/test-container.sh, after the build, as root in a private mount namespace:
the tmpfs it mounts for /dev/shm and the volumes go with it. The containers it makes are named
tsm-test-container-* and removed at the end (and at the start, if a killed run left any). Prints
each step; exits 0 only if every check passed.
"""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from containers import (BUILDAH, CONSUMER, CONTAINER_PREFIX, Daemon, TestFailure, buildah, check,
                        exchange, image_config, private_tmpfs, step, unmount, user_ids,
                        with_client)
from pods import test_daemonset, test_sidecar

LOADER = "/lib64/ld-linux-x86-64.so.2"


def test_image(image, container, work):
    """ENTRYPOINT + CMD as the image's USER, the HEALTHCHECK command, a tensor through it,
    tensorshmctl, SIGTERM."""
    config = image_config(image)
    env = dict(e.split("=", 1) for e in config.get("Env") or [])
    uid, gid = user_ids(container, config.get("User") or "0")
    step(f"image config: USER {config.get('User')}, ENTRYPOINT {config.get('Entrypoint')}, "
         f"CMD {config.get('Cmd')}, VOLUME {sorted(config.get('Volumes') or {})}, "
         f"STOPSIGNAL {config.get('StopSignal')}, HEALTHCHECK {config.get('Healthcheck')}")
    check(uid != 0, f"the image runs as a non-root user (uid {uid})")
    socket = env.get("TENSORSHM_SOCKET", "")
    socket_dir = os.path.dirname(socket)
    check(socket_dir in (config.get("Volumes") or {}), f"TENSORSHM_SOCKET={socket} lies in a VOLUME")
    check(config.get("StopSignal") == "SIGTERM", "STOPSIGNAL SIGTERM")
    healthcheck = (config.get("Healthcheck") or {}).get("Test") or []
    check(healthcheck[:1] == ["CMD"], f"a HEALTHCHECK CMD is declared: {healthcheck}")
    st = os.stat(container.path(socket_dir))
    check(st.st_uid == uid and st.st_mode & 0o022 == 0,
          f"{socket_dir} belongs to uid {uid}, mode {oct(st.st_mode & 0o7777)}")

    for binary in ("/usr/local/bin/tensorshmd", "/usr/local/bin/tensorshmctl", CONSUMER):
        rc, listing = container.run([LOADER, "--list", binary])
        missing = [l.strip() for l in listing.splitlines() if "not found" in l]
        count = sum(1 for l in listing.splitlines() if "=>" in l)
        check(rc == 0 and not missing, f"every library of {binary} is in the runtime image "
                                       f"({LOADER} --list: {count} found, missing {missing})")
    rc, packages = container.run(["dpkg-query", "-W", "-f", "${Package}\n"])
    dev = [p for p in packages.split() if p.endswith("-dev") or p in ("gcc", "g++", "cmake")]
    check(rc == 0 and not dev, f"no compiler or -dev package in the runtime image ({dev})")
    size = buildah("images", "--noheading", "--format", "{{.Size}}", image).split("\n")[0]
    step(f"image {image}: {size}")

    # What an engine gives: a 64 MiB /dev/shm, and a named volume at the VOLUME that starts as a
    # copy of the image's directory (owner and mode).
    private_tmpfs("/dev/shm", "mode=1777,nosuid,nodev,size=64m")
    volume = os.path.join(work, "image-socket-volume")
    os.mkdir(volume)
    os.chown(volume, st.st_uid, st.st_gid)
    os.chmod(volume, st.st_mode & 0o7777)
    options = {"user": (uid, gid), "volumes": [(volume, socket_dir, False)]}
    host_socket = os.path.join(volume, os.path.basename(socket))
    argv = (config.get("Entrypoint") or []) + (config.get("Cmd") or [])
    daemon = Daemon(container, argv, os.path.join(work, "image-daemon.log"), **options)
    try:
        daemon.wait_serving()
        check(os.path.exists(host_socket), f"{socket} exists")
        rc, out = container.run(healthcheck[1:], **options)
        step(f"HEALTHCHECK {shlex.join(healthcheck[1:])} -> exit {rc}: {out}")
        check(rc == 0, "the HEALTHCHECK command exits 0 while the daemon serves")
        exchange(container, (uid, gid), (uid, gid), socket, "container/image-test",
                 volumes=options["volumes"])
        for args in (["ls"], ["ls", "-o", "json"], ["inspect", "container/image-test"]):
            rc, out = container.run(["tensorshmctl"] + args, **options)
            step(f"tensorshmctl {' '.join(args)} -> exit {rc}:\n{out}")
            check(rc == 0 and "container/image-test" in out,
                  f"tensorshmctl {' '.join(args)} shows the published tensor")
        rc = daemon.stop(signal.SIGTERM)
        step("daemon output:\n" + daemon.output())
        check(rc == 0, f"SIGTERM: tensorshmd exited {rc}")
        daemon = None
        check(not os.path.exists(host_socket), f"SIGTERM: {socket} removed")
        rc, out = container.run(healthcheck[1:], **options)
        check(rc != 0, f"the HEALTHCHECK command fails once the daemon is gone (exit {rc})")
        leftovers = os.listdir("/dev/shm")
        check(not leftovers, f"SIGTERM: nothing left in the container's /dev/shm ({leftovers})")
    finally:
        if daemon is not None:
            daemon.kill()
        unmount("/dev/shm")


def remove_test_containers():
    names = buildah("containers", "--noheading", "--format", "{{.ContainerName}}").split()
    for name in names:
        if name.startswith(CONTAINER_PREFIX):
            subprocess.run(BUILDAH + ["rm", name], capture_output=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--image", required=True, help="the image built from the Dockerfile")
    parser.add_argument("--build-image", required=True,
                        help="its build stage (buildah bud --target build)")
    parser.add_argument("--manifests", default="deploy/kubernetes")
    args = parser.parse_args()
    if os.geteuid() != 0 or not BUILDAH:
        print("test-container: run by tests/container/test-container.sh (root, $BUILDAH)",
              file=sys.stderr)
        return 1
    started = time.monotonic()
    ok = False
    # SIGTERM ends the run as Ctrl-C does: daemons stopped, containers removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("test-container: terminated"))
    remove_test_containers()
    work = tempfile.mkdtemp(prefix="tsm-container.", dir=os.environ.get("TMPDIR", "/var/tmp"))
    os.chmod(work, 0o755)  # the containers' users reach their volumes under it
    try:
        container = with_client(args.image, args.build_image, "image", work)
        test_image(args.image, container, work)
        test_sidecar(args.image, args.build_image, work,
                     os.path.join(args.manifests, "sidecar.yaml"))
        test_daemonset(args.image, args.build_image, work,
                       os.path.join(args.manifests, "daemonset.yaml"))
        ok = True
    except TestFailure as e:
        print(f"test-container: FAILED: {e}", file=sys.stderr, flush=True)
    finally:
        remove_test_containers()
        subprocess.run(["rm", "-rf", "--one-file-system", work])
    print(f"test-container: {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
