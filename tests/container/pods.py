"""The Kubernetes manifests' containers (deploy/kubernetes/sidecar.yaml and daemonset.yaml) run
in the image the way kubelet would run them, for tests/container/container_test.py."""

import os
import re

import yaml

from containers import (CAP_BITS, CONSUMER, Daemon, TestFailure, check, exchange, image_config,
                        mount, private_tmpfs, step, unmount, user_ids, with_client)


def quantity(text):
    """A Kubernetes quantity (64Mi, 1Gi, 500M) in bytes."""
    number, unit, binary = re.fullmatch(r"(\d+)([KMGT]?)(i?)", str(text)).groups()
    return int(number) * (1024 if binary else 1000) ** (" KMGT".index(unit) if unit else 0)


def load(manifest):
    with open(manifest) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def pod_spec(doc):
    return doc["spec"]["template"]["spec"] if doc["kind"] == "DaemonSet" else doc["spec"]


class Pod:
    """A Pod's containers as kubelet runs them, all in one working container of the image (plus
    the test's client) standing for each container's own copy of it:

    - the root read-only (readOnlyRootFilesystem), except /run: buildah writes /run/.containerenv
      on every run (podman's --read-only leaves /run writable too);
    - the Pod's volumes at their mount paths: an emptyDir is a tmpfs of its sizeLimit, mode 0777
      as kubelet makes it (a memory emptyDir at /dev/shm is the test namespace's /dev/shm, which
      buildah's chroot isolation gives every container); a hostPath is a directory of the
      "node" (work/node), made root 0755 as DirectoryOrCreate does; a ConfigMap its keys as files,
      read-only;
    - each container's uid and gid (runAsUser, runAsGroup; else the image's USER), capabilities
      (drop ALL, add ...), allowPrivilegeEscalation: false (no_new_privs), env, command and args
      over the image's ENTRYPOINT and CMD.
    """

    def __init__(self, image, build_image, work, name, spec, docs):
        self.config = image_config(image)
        self.container = with_client(image, build_image, f"pod-{name}", work)
        self.image_user = user_ids(self.container, self.config.get("User") or "0")
        self.spec = spec
        self.docs = docs
        self.work = work
        self.name = name
        self.mounts = []
        self.sources = {}  # volume name -> its host directory (None: the namespace's /dev/shm)
        self.read_only = set()  # volumes kubelet mounts read-only whatever the container says

    def __enter__(self):
        try:
            self.make_volumes()
            root = self.container.root
            mount("--bind", root, root)
            self.mounts.append(root)
            mount("-o", "remount,bind,ro", root)
            mount("--bind", f"{root}/run", f"{root}/run")
            self.mounts.append(f"{root}/run")
            mount("-o", "remount,bind,rw", f"{root}/run")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for target in reversed(self.mounts):
            unmount(target)
        self.mounts = []
        self.container.remove()

    def make_volumes(self):
        mount_paths = {}
        for c in self.spec.get("initContainers", []) + self.spec["containers"]:
            for m in c.get("volumeMounts", []):
                mount_paths[m["name"]] = m["mountPath"]
                # A runtime makes missing mount points on the container's own layer.
                os.makedirs(self.container.path(m["mountPath"]), exist_ok=True)
        for volume in self.spec["volumes"]:
            name = volume["name"]
            if "emptyDir" in volume:
                size = volume["emptyDir"].get("sizeLimit", "64Mi")
                medium = " (medium Memory)" if volume["emptyDir"].get("medium") else ""
                if mount_paths.get(name) == "/dev/shm":
                    target, self.sources[name] = "/dev/shm", None
                else:
                    target = self.sources[name] = os.path.join(self.work, f"pod-{self.name}-{name}")
                private_tmpfs(target, f"mode=0777,size={quantity(size)}")
                self.mounts.append(target)
                step(f"volume {name}: emptyDir{medium} at {mount_paths.get(name)}, mode 0777, "
                     f"size {size}")
            elif "hostPath" in volume:
                path = volume["hostPath"]["path"]
                source = self.sources[name] = os.path.join(self.work, "node", path.lstrip("/"))
                if not os.path.isdir(source):
                    os.makedirs(source)
                    os.chmod(source, 0o755)
                step(f"volume {name}: hostPath {path} at {mount_paths.get(name)}")
            elif "configMap" in volume:
                config_map = volume["configMap"]["name"]
                data = next(d for d in self.docs if d["kind"] == "ConfigMap"
                            and d["metadata"]["name"] == config_map)["data"]
                source = self.sources[name] = os.path.join(self.work, f"configmap-{config_map}")
                os.makedirs(source, exist_ok=True)
                for key, text in data.items():
                    with open(os.path.join(source, key), "w") as f:
                        f.write(text)
                    os.chmod(os.path.join(source, key), 0o644)
                self.read_only.add(name)
                step(f"volume {name}: ConfigMap {config_map} at {mount_paths.get(name)}")
            else:
                raise TestFailure(f"volume {name}: a kind this test does not know: {volume}")

    def security(self, container):
        context = dict(self.spec.get("securityContext", {}))
        context.update(container.get("securityContext", {}))
        return context

    def user(self, container):
        context = self.security(container)
        return (context.get("runAsUser", self.image_user[0]),
                context.get("runAsGroup", self.image_user[1]))

    def options(self, container):
        """Container.argv's options for one of the Pod's containers."""
        context = self.security(container)
        capabilities = context.get("capabilities", {})
        caps = None
        if "ALL" in capabilities.get("drop", []):
            caps = [c.removeprefix("CAP_") for c in capabilities.get("add", [])]
        volumes = [(self.sources[m["name"]], m["mountPath"],
                    m.get("readOnly", False) or m["name"] in self.read_only)
                   for m in container.get("volumeMounts", []) if self.sources[m["name"]]]
        return {"user": self.user(container), "volumes": volumes,
                "env": [(e["name"], e["value"]) for e in container.get("env", [])],
                "caps": caps, "no_new_privs": context.get("allowPrivilegeEscalation") is False}

    def argv(self, container):
        command = container.get("command") or self.config.get("Entrypoint") or []
        if "args" in container or "command" in container:
            args = container.get("args", [])
        else:
            args = self.config.get("Cmd") or []
        return list(command) + list(args)

    def env(self, container, name):
        return next(e["value"] for e in container.get("env", []) if e["name"] == name)

    def run(self, container, argv=None):
        return self.container.run(argv or self.argv(container), **self.options(container))

    def daemon(self, container, log_name):
        return Daemon(self.container, self.argv(container), os.path.join(self.work, log_name),
                      **self.options(container))

    def check_security(self, container):
        """The container gets what its securityContext says (checked, since buildah applies it)."""
        options = self.options(container)
        rc, status = self.run(container, ["cat", "/proc/self/status"])
        if rc != 0:
            raise TestFailure(f"container {container['name']}: cat /proc/self/status exited "
                              f"{rc}: {status}")
        fields = dict(l.split(":\t", 1) for l in status.splitlines() if ":\t" in l)
        uid = int(fields["Uid"].split()[0])
        expected = 0
        if uid == 0:
            kept = options["caps"] if options["caps"] is not None else CAP_BITS
            expected = sum(1 << CAP_BITS[c] for c in kept)
        check((uid, int(fields["Gid"].split()[0])) == options["user"]
              and int(fields["CapEff"], 16) == expected
              and fields["NoNewPrivs"].strip() == ("1" if options["no_new_privs"] else "0"),
              f"container {container['name']}: uid {uid}, CapEff {fields['CapEff'].strip()}, "
              f"NoNewPrivs {fields['NoNewPrivs'].strip()}")


def probe(pod, container, what):
    command = container["startupProbe"]["exec"]["command"]
    rc, out = pod.run(container, command)
    step(f"{what}: startupProbe {' '.join(command)} -> exit {rc}: {out}")
    check(rc == 0, f"{what}: the probe passes while the daemon serves")


def run_init_containers(pod, containers):
    for c in containers:
        pod.check_security(c)
        rc, out = pod.run(c)
        step(f"init container {c['name']}: {' '.join(pod.argv(c))} -> exit {rc} {out}")
        check(rc == 0, f"init container {c['name']} succeeds")


def test_sidecar(image, build_image, work, manifest):
    """sidecar.yaml's containers in the image: the emptyDir refused as it comes, the init
    container's chmod, the daemon as its securityContext says, the app (another uid) through
    the shared socket, SIGTERM with segments kept, restarts that recover them."""
    docs = load(manifest)
    pod = next(d for d in docs if d["kind"] == "Pod")
    spec = pod_spec(pod)
    init = [c for c in spec["initContainers"] if c.get("restartPolicy") != "Always"]
    daemon_c = next(c for c in spec["initContainers"] + spec["containers"]
                    if c["name"] == "tensorshmd")
    app = next(c for c in spec["containers"] if c["name"] != "tensorshmd")
    step(f"sidecar.yaml: Pod {pod['metadata']['name']}: init {[c['name'] for c in init]}, "
         f"daemon {daemon_c['name']}, app {app['name']}")
    with Pod(image, build_image, work, "sidecar", spec, docs) as view:
        # Without the init step the daemon must refuse the emptyDir (0777, not sticky).
        rc, out = view.run(daemon_c)
        step(f"daemon on the bare emptyDir -> exit {rc}: {out}")
        check(rc != 0 and "--socket" in out, "the daemon refuses the emptyDir as kubelet makes it")
        run_init_containers(view, init)
        view.check_security(daemon_c)
        view.check_security(app)
        uid, gid = view.user(daemon_c)
        app_user = view.user(app)
        socket = view.env(app, "TENSORSHM_SOCKET")
        daemon = view.daemon(daemon_c, "sidecar-daemon.log")
        try:
            daemon.wait_serving()
            probe(view, daemon_c, "sidecar")
            # A client of another uid names the daemon's uid (ClientOptions::server_uid).
            exchange(view.container, app_user, app_user, socket, "sidecar/app-tensor", uid,
                     **view.options(app))
            rc = daemon.stop()
            step("daemon output:\n" + daemon.output())
            check(rc == 0, f"SIGTERM: the sidecar daemon exited {rc}")
            kept = sorted(os.listdir("/dev/shm"))
            check(kept, f"--keep-segments: the segments stay in the Pod's /dev/shm: {kept}")
            # The container restarts (crash, liveness, OOM): the same args recover the tensors.
            daemon = view.daemon(daemon_c, "sidecar-daemon-2.log")
            daemon.wait_serving()
            check("recovered" in daemon.output(), "the restarted daemon recovered the segments")
            # A tensor of the daemon's own uid, published before the next restart, is served
            # again after it.
            exchange(view.container, (uid, gid), (uid, gid), socket, "sidecar/own-tensor",
                     **view.options(daemon_c))
            rc = daemon.stop()
            check(rc == 0, f"SIGTERM: exit {rc}")
            daemon = view.daemon(daemon_c, "sidecar-daemon-3.log")
            daemon.wait_serving()
            rc, out = view.run(daemon_c, [CONSUMER, "consume", socket, "sidecar/own-tensor"])
            step(f"consume sidecar/own-tensor after a restart as uid {uid}: exit {rc}, sum {out}")
            check(rc == 0 and out, "the own-uid tensor outlived the restart")
            # The app's tensor (admitted by --allow-uid) was in a memfd segment reserved to that
            # uid: by design it does not outlive the daemon (docs/security.md, Access), and the first
            # restarted daemon said so in its log.
            rc, out = view.run(app, [CONSUMER, "consume", socket, "sidecar/app-tensor", str(uid)])
            step(f"consume sidecar/app-tensor after the restarts as uid {app_user[0]}: "
                 f"exit {rc}, {out}")
            with open(os.path.join(work, "sidecar-daemon-2.log")) as f:
                log = f.read()
            check(rc != 0 and
                  f"was uid {app_user[0]}'s, in a memfd segment reserved to that uid" in log,
                  "another uid's tensor ended with the daemon, and the recovery log says why")
            rc = daemon.stop()
            check(rc == 0, f"SIGTERM after recovery: exit {rc}")
            daemon = None
        finally:
            if daemon is not None:
                daemon.kill()


def test_daemonset(image, build_image, work, manifest):
    """daemonset.yaml: the init container's chown of the hostPath (CAP_CHOWN only), then the
    daemon with the ConfigMap's TOML, and the client Pod's uid/gid through the host directory."""
    docs = load(manifest)
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    spec = pod_spec(ds)
    client_spec = pod_spec(next(d for d in docs if d["kind"] == "Pod"))
    daemon_c = next(c for c in spec["containers"] if c["name"] == "tensorshmd")
    client_c = client_spec["containers"][0]
    with Pod(image, build_image, work, "daemonset", spec, docs) as view:
        run_init_containers(view, spec["initContainers"])
        view.check_security(daemon_c)
        socket = view.env(daemon_c, "TENSORSHM_SOCKET")
        socket_volume = next(m["name"] for m in daemon_c["volumeMounts"]
                             if m["mountPath"] == os.path.dirname(socket))
        st = os.stat(view.sources[socket_volume])
        uid, gid = view.user(daemon_c)
        check(st.st_uid == uid and st.st_mode & 0o7777 == 0o711,
              f"the host directory is the daemon's (uid {st.st_uid}), mode "
              f"{oct(st.st_mode & 0o7777)}")
        daemon = view.daemon(daemon_c, "daemonset-daemon.log")
        try:
            daemon.wait_serving()
            probe(view, daemon_c, "daemonset")
            # The client Pod: its own container, the node's directory read-only, its uid and
            # primary gid (admitted by --allow-gid).
            with Pod(image, build_image, work, "client", client_spec, docs) as client:
                client.check_security(client_c)
                user = client.user(client_c)
                exchange(client.container, user, user, socket, "daemonset/client-tensor", uid,
                         **client.options(client_c))
            rc = daemon.stop()
            step("daemon output:\n" + daemon.output())
            check(rc == 0, f"SIGTERM: the DaemonSet's daemon exited {rc}")
            daemon = None
        finally:
            if daemon is not None:
                daemon.kill()
