#!/usr/bin/env python3
"""`make test-container`: builds the Dockerfile for real in bookworm chroots (dockerfile_chroot)
and runs the image's daemon the way an engine would, then the Kubernetes manifests' containers.

Run by tests/container/test-container.sh as root in a private mount namespace. Prints each step;
exits 0 only if every check passed (checks whose interface is not merged yet say SKIP with the
reason).
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
CONSUMER_SOURCE = "/src/tests/container/client"
CONSUMER = "/usr/local/bin/tensorshm_container_client"
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
    step("test client: tests/container/client built in the build stage against the installed "
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
    shutil.copy2(os.path.join(build_stage.root, "opt/tsm-consumer/tensorshm_container_client"), target)


def exchange(root, env, producer, consumer, socket, name, server_uid=None):
    """Publishes 1000 doubles as `producer` (uid, gid), acquires them as `consumer`."""
    sums = []
    extra = [str(server_uid)] if server_uid is not None else []
    for verb, user in (("produce", producer), ("consume", consumer)):
        result = dc.spawn(root, [CONSUMER, verb, socket, name] + extra, env, user,
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
        count = sum(1 for l in listing.splitlines() if "=>" in l)
        check(not missing, f"every library of {binary} is in the runtime image "
                           f"({LOADER} --list: {count} found, {len(missing)} not found)")
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


def k8s_quantity(text):
    match = __import__("re").fullmatch(r"(\d+)([KMGT]?)(i?)", str(text))
    number, unit, binary = match.groups()
    return int(number) * (1024 if binary else 1000) ** (" KMGT".index(unit) if unit else 0)


def pod_spec(doc):
    return doc["spec"]["template"]["spec"] if doc["kind"] == "DaemonSet" else doc["spec"]


def container_user(spec, container):
    sc = dict(spec.get("securityContext", {}))
    sc.update(container.get("securityContext", {}))
    return sc.get("runAsUser", 0), sc.get("runAsGroup", 0), sc


def container_caps(sc):
    caps = sc.get("capabilities", {})
    if "ALL" not in caps.get("drop", []):
        return None
    return caps.get("add", [])


class PodView:
    """A Pod's containers on the image root, as kubelet would give them: the root read-only
    (readOnlyRootFilesystem), /proc, /dev, and the Pod's volumes at their mount paths."""

    def __init__(self, runtime, work, name, spec, docs):
        self.runtime = runtime
        self.spec = spec
        self.root = os.path.join(work, f"pod-{name}")
        self.mounts = Mounts()
        self.host = os.path.join(work, f"pod-{name}-host")
        os.makedirs(self.root)
        os.makedirs(self.host)
        self.docs = docs

    def __enter__(self):
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        mounted = {}
        for c in self.spec.get("initContainers", []) + self.spec["containers"]:
            for m in c.get("volumeMounts", []):
                mounted[m["mountPath"]] = volumes[m["name"]]
        # Mount points the image lacks are made in the image's root first (a runtime does that
        # on its own layer).
        for path in mounted:
            os.makedirs(os.path.join(self.runtime.root, path.lstrip("/")), exist_ok=True)
        self.mounts.mount(["--bind", self.runtime.root], self.root)
        run_checked(["mount", "-o", "remount,bind,ro", self.root])
        self.mounts.container(self.root)
        for path, volume in sorted(mounted.items()):
            target = os.path.join(self.root, path.lstrip("/"))
            if path == "/dev/shm":
                self.mounts.points.remove(target) if target in self.mounts.points else None
                subprocess.run(["umount", target], check=True)
            if "emptyDir" in volume:
                size = volume["emptyDir"].get("sizeLimit", "64Mi")
                # kubelet makes an emptyDir mode 0777 (root-owned, not sticky).
                self.mounts.mount(["-t", "tmpfs", "-o",
                                   f"mode=0777,size={k8s_quantity(size)}", "tmpfs"], target)
                step(f"volume {volume['name']}: emptyDir at {path}, mode 0777, "
                     f"size {size}{' (medium Memory)' if volume['emptyDir'].get('medium') else ''}")
            elif "hostPath" in volume:
                source = os.path.join(self.host, volume["hostPath"]["path"].lstrip("/"))
                # DirectoryOrCreate: kubelet makes it mode 0755, owned by root.
                os.makedirs(source, mode=0o755, exist_ok=True)
                os.chmod(source, 0o755)
                self.mounts.mount(["--bind", source], target)
                step(f"volume {volume['name']}: hostPath {volume['hostPath']['path']} at {path}, "
                     "root 0755")
            elif "configMap" in volume:
                name = volume["configMap"]["name"]
                data = next(d for d in self.docs if d["kind"] == "ConfigMap"
                            and d["metadata"]["name"] == name)["data"]
                source = os.path.join(self.host, "configmap-" + name)
                os.makedirs(source)
                for key, text in data.items():
                    with open(os.path.join(source, key), "w") as f:
                        f.write(text)
                    os.chmod(os.path.join(source, key), 0o644)
                os.chmod(source, 0o755)
                self.mounts.mount(["--bind", "-o", "ro", source], target)
                step(f"volume {volume['name']}: ConfigMap {name} at {path}")
        return self

    def __exit__(self, *exc):
        self.mounts.unmount_all()

    def env(self, container):
        env = image_env(self.runtime, "/nonexistent")
        env.update({e["name"]: e["value"] for e in container.get("env", [])})
        return env

    def argv(self, container):
        config = self.runtime.config
        command = container.get("command") or config["Entrypoint"] or []
        args = container.get("args") if "args" in container or "command" in container \
            else config["Cmd"]
        return list(command) + list(args or [])

    def spawn(self, container, argv=None, **kwargs):
        uid, gid, sc = container_user(self.spec, container)
        return dc.spawn(self.root, argv or self.argv(container), self.env(container), (uid, gid),
                        keep_caps=container_caps(sc),
                        no_new_privs=sc.get("allowPrivilegeEscalation") is False, **kwargs)

    def run(self, container, argv=None):
        process = self.spawn(container, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        out, _ = process.communicate()
        return process.returncode, out

    def daemon(self, container, log_name):
        uid, gid, sc = container_user(self.spec, container)
        return Daemon(self.root, self.argv(container), self.env(container), (uid, gid),
                      log_name, keep_caps=container_caps(sc),
                      no_new_privs=sc.get("allowPrivilegeEscalation") is False)


def run_checked(argv):
    subprocess.run(argv, check=True)


def probe(pod, container, has_ctl, what):
    command = container["startupProbe"]["exec"]["command"] if "startupProbe" in container \
        else container["readinessProbe"]["exec"]["command"]
    if not has_ctl:
        skip(f"{what}: probe {' '.join(command)}", "tensorshmctl not built yet")
        return
    rc, out = pod.run(container, command)
    step(f"{what}: probe {' '.join(command)} -> exit {rc}: {out.strip()}")
    check(rc == 0, f"{what}: the probe passes while the daemon serves")


def test_sidecar(runtime, work, manifest, has_ctl):
    """sidecar.yaml's containers in the image: the emptyDir refused as it comes, the init
    container's chmod, the daemon as its securityContext says, the app (another uid) through
    the shared socket, SIGTERM with segments kept, a restart that recovers them."""
    import yaml
    with open(manifest) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    pod = next(d for d in docs if d["kind"] == "Pod")
    spec = pod_spec(pod)
    init = [c for c in spec["initContainers"] if c.get("restartPolicy") != "Always"]
    daemon_c = next(c for c in spec["initContainers"] + spec["containers"]
                    if c["name"] == "tensorshmd")
    app = next(c for c in spec["containers"] if c["name"] != "tensorshmd")
    step(f"sidecar.yaml: Pod {pod['metadata']['name']}: init {[c['name'] for c in init]}, "
         f"daemon {daemon_c['name']}, app {app['name']}")
    with PodView(runtime, work, "sidecar", spec, docs) as view:
        # Without the init step the daemon must refuse the emptyDir (0777, not sticky).
        uid, gid, _ = container_user(spec, daemon_c)
        rc, out = view.run(daemon_c)
        step(f"daemon on the bare emptyDir -> exit {rc}: {out.strip()}")
        check(rc != 0 and "--socket" in out, "the daemon refuses the emptyDir as kubelet makes it")
        for c in init:
            rc, out = view.run(c, c["command"])
            step(f"init container {c['name']}: {' '.join(c['command'])} -> exit {rc} {out.strip()}")
            check(rc == 0, f"init container {c['name']} succeeds (uid 0, no capability)")
        daemon = view.daemon(daemon_c, os.path.join(work, "sidecar-daemon.log"))
        try:
            daemon.wait_serving()
            probe(view, daemon_c, has_ctl, "sidecar")
            socket = view.env(app)["TENSORSHM_SOCKET"]
            app_user = container_user(spec, app)[:2]
            env = view.env(app)
            # A client of another uid names the daemon's uid (ClientOptions::server_uid).
            exchange(view.root, env, app_user, app_user, socket, "sidecar/app-tensor", uid)
            rc = daemon.stop()
            step("daemon output:\n" + daemon.output().rstrip())
            check(rc == 0, f"SIGTERM: the sidecar daemon exited {rc}")
            kept = sorted(os.listdir(os.path.join(view.root, "dev/shm")))
            check(kept, f"--keep-segments: the segments stay in the Pod's /dev/shm: {kept}")
            # The container restarts (crash, liveness, OOM): the same args recover the tensors.
            daemon = view.daemon(daemon_c, os.path.join(work, "sidecar-daemon-2.log"))
            daemon.wait_serving()
            check("recovered" in daemon.output(), "the restarted daemon recovered the segments")
            # A tensor of the daemon's own uid, published before the restart, is served again.
            exchange(view.root, view.env(daemon_c), (uid, gid), (uid, gid), socket,
                     "sidecar/own-tensor")
            rc = daemon.stop()
            check(rc == 0, f"SIGTERM: exit {rc}")
            daemon = view.daemon(daemon_c, os.path.join(work, "sidecar-daemon-3.log"))
            daemon.wait_serving()
            result = dc.spawn(view.root, [CONSUMER, "consume", socket, "sidecar/own-tensor"],
                              view.env(daemon_c), (uid, gid), stdout=subprocess.PIPE, text=True)
            out, _ = result.communicate()
            step(f"consume sidecar/own-tensor after a restart as uid {uid}: "
                 f"exit {result.returncode}, sum {out.strip()}")
            check(result.returncode == 0 and out.strip(), "the own-uid tensor outlived the restart")
            # The app's tensor (uid 10002, admitted by --allow-uid) was in a memfd segment
            # reserved to that uid: by design it does not outlive the daemon (README, Access),
            # and the restarted daemon says so in its log.
            result = dc.spawn(view.root, [CONSUMER, "consume", socket, "sidecar/app-tensor",
                                          str(uid)], env, app_user, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
            out, err = result.communicate()
            step(f"consume sidecar/app-tensor after the restarts as uid {app_user[0]}: "
                 f"exit {result.returncode}, {out.strip() or err.strip()}")
            log = open(os.path.join(work, "sidecar-daemon-2.log")).read()
            check(result.returncode != 0 and
                  f"was uid {app_user[0]}'s, in a memfd segment reserved to that uid" in log,
                  "another uid's tensor ended with the daemon, and the recovery log says why")
            rc = daemon.stop()
            check(rc == 0, f"SIGTERM after recovery: exit {rc}")
            daemon = None
        finally:
            if daemon is not None:
                daemon.kill()
                step("daemon output:\n" + daemon.output().rstrip())


def test_daemonset(runtime, work, manifest, has_ctl):
    """daemonset.yaml: the init container's chown of the hostPath (CAP_CHOWN only), then the
    daemon with the ConfigMap's TOML, and the client Pod's uid/gid through the host directory."""
    import yaml
    with open(manifest) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    client = next(d for d in docs if d["kind"] == "Pod")
    spec = pod_spec(ds)
    init = spec["initContainers"]
    daemon_c = next(c for c in spec["containers"] if c["name"] == "tensorshmd")
    with PodView(runtime, work, "daemonset", spec, docs) as view:
        for c in init:
            rc, out = view.run(c, c["command"])
            step(f"init container {c['name']}: {' '.join(c['command'])} -> exit {rc} {out.strip()}")
            check(rc == 0, f"init container {c['name']} succeeds (uid 0, CAP_CHOWN only)")
        socket = view.env(daemon_c)["TENSORSHM_SOCKET"]
        st = os.stat(os.path.join(view.root, os.path.dirname(socket).lstrip("/")))
        uid, gid, _ = container_user(spec, daemon_c)
        check(st.st_uid == uid and st.st_mode & 0o7777 == 0o711,
              f"the host directory is the daemon's (uid {st.st_uid}), mode "
              f"{oct(st.st_mode & 0o7777)}")
        help_text = view.run(daemon_c, [view.argv(daemon_c)[0], "--help"])[1]
        if "--config" not in help_text:
            skip("DaemonSet daemon with its ConfigMap TOML", "tensorshmd --config not merged yet")
            return
        daemon = view.daemon(daemon_c, os.path.join(work, "daemonset-daemon.log"))
        try:
            daemon.wait_serving()
            probe(view, daemon_c, has_ctl, "daemonset")
            c_spec = pod_spec(client)
            c = c_spec["containers"][0]
            user = container_user(c_spec, c)[:2]
            exchange(view.root, view.env(c), user, user, socket, "daemonset/client-tensor", uid)
            rc = daemon.stop()
            step("daemon output:\n" + daemon.output().rstrip())
            check(rc == 0, f"SIGTERM: the DaemonSet's daemon exited {rc}")
            daemon = None
        finally:
            if daemon is not None:
                daemon.kill()
                step("daemon output:\n" + daemon.output().rstrip())


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
        has_ctl = os.path.exists(os.path.join(runtime.root, "usr/local/bin/tensorshmctl"))
        kube = os.path.join(args.context, "deploy", "kubernetes")
        test_sidecar(runtime, work, os.path.join(kube, "sidecar.yaml"), has_ctl)
        test_daemonset(runtime, work, os.path.join(kube, "daemonset.yaml"), has_ctl)
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
