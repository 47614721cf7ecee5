"""deploy/: the Kubernetes manifests, the systemd unit and the TOML configs, checked against the
Kubernetes schema and against the daemon that is built here (its flags, its sizes).

The flags of interfaces that other work adds (--config, --metrics, --evict) are checked as soon
as `tensorshmd --help` lists them; until then those checks skip and say so.
"""

import os
import re
import shutil
import subprocess
import tomllib

import kubernetes_validate
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KUBE_DIR = os.path.join(ROOT, "deploy", "kubernetes")
SYSTEMD_DIR = os.path.join(ROOT, "deploy", "systemd")
# The Kubernetes version the manifests are written for (native sidecars: >= 1.29).
KUBERNETES_VERSION = "1.30.0"
SOCKET_ENV = "TENSORSHM_SOCKET"
# tensorshmctl gives up (and says why) before the kubelet kills it: --timeout < timeoutSeconds.
HEALTH_TIMEOUT_SECONDS = 2
HEALTH = ["tensorshmctl", "--timeout", f"{HEALTH_TIMEOUT_SECONDS}s", "health"]
# Daemon flags that the manifests use before every tensorshmd has them (other work adds them):
# where the daemon built here does not list one yet, the checks that run it skip and say so.
PENDING_FLAGS = {"--shm-group": "--shm-group GID makes host segments 0660 in GID, for Triton"}


def daemon_binary():
    path = os.environ.get("TENSORSHMD", os.path.join(ROOT, "build", "tensorshmd"))
    if not os.access(path, os.X_OK):
        pytest.skip(f"tensorshmd not built ({path}): run cmake --build build --target tensorshmd")
    return path


def daemon_help():
    return subprocess.run([daemon_binary(), "--help"], capture_output=True, text=True,
                          check=True).stdout


def known_flags():
    return set(re.findall(r"^\s+(--[a-z0-9-]+)", daemon_help(), re.M))


def parse_size(text):
    """The daemon's sizes (K/M/G/T, Ki/Mi/Gi/Ti) and Kubernetes quantities of the same forms."""
    match = re.fullmatch(r"(\d+)([KMGT]?)(i?)B?", str(text))
    assert match, f"not a size: {text!r}"
    number, unit, binary = match.groups()
    power = " KMGT".index(unit) if unit else 0
    return int(number) * (1024 if binary else 1000) ** power


def catalog_bytes(max_tensors):
    """ControlSegmentBytes (common/shm/catalog_layout.h): header + segment records + tensor records,
    with the constants read from the header so that a layout change is followed."""
    with open(os.path.join(ROOT, "common", "shm", "catalog_layout.h")) as f:
        header = f.read()
    header_bytes = int(re.search(r"kControlHeaderBytes = (\d+);", header).group(1))
    max_segments = int(re.search(r"kMaxSegments = (\d+);", header).group(1))
    segment_record = int(re.search(r"sizeof\(SegmentRecord\) == (\d+)", header).group(1))
    tensor_record = int(re.search(r"sizeof\(TensorRecord\) == (\d+)", header).group(1))
    return header_bytes + max_segments * segment_record + max_tensors * tensor_record


def manifest_files():
    return sorted(os.path.join(KUBE_DIR, f) for f in os.listdir(KUBE_DIR) if f.endswith(".yaml"))


def documents(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def pod_specs():
    """(where, Pod spec, the file's documents) of every Pod and Pod template in deploy/."""
    found = []
    for path in manifest_files():
        docs = documents(path)
        for doc in docs:
            where = f"{os.path.basename(path)}: {doc['kind']} {doc['metadata']['name']}"
            if doc["kind"] == "Pod":
                found.append((where, doc["spec"], docs))
            elif doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
                found.append((where, doc["spec"]["template"]["spec"], docs))
    return found


def daemon_specs():
    """pod_specs() with a tensorshmd container."""
    return [(w, s, d) for w, s, d in pod_specs() if daemon_container(s) is not None]


def daemon_container(spec):
    """The tensorshmd container of a Pod spec (a native sidecar or a plain container), or None."""
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        if c["name"] == "tensorshmd":
            return c
    return None


DAEMON_IDS = [w for w, _, _ in daemon_specs()]


def app_containers(spec):
    return [c for c in spec.get("containers", []) if c["name"] != "tensorshmd"]


# Servers that open tensorshm's segments by name (Triton's system shared-memory extension): they
# share the daemon's /dev/shm and its --shm-group instead of talking to the daemon.
SHM_SERVER_IMAGES = ("nvcr.io/nvidia/tritonserver:",)


def shm_servers(spec):
    return [c for c in app_containers(spec) if c["image"].startswith(SHM_SERVER_IMAGES)]


def client_containers(spec):
    """The app containers that talk to tensorshmd: all but the servers that map segments by name."""
    servers = shm_servers(spec)
    return [c for c in app_containers(spec) if c not in servers]


def env_value(container, name):
    for e in container.get("env", []):
        if e["name"] == name:
            return e.get("value")
    return None


def security(spec, container, key):
    """A container's securityContext field, else the Pod's."""
    value = container.get("securityContext", {}).get(key)
    return spec.get("securityContext", {}).get(key) if value is None else value


def config_map_file(docs, spec, container, path):
    """The text of the file `path` in a container, from the ConfigMap volume mounted above it
    (through the volume's items, where it has any)."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    name = volume["configMap"]["name"]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name)
    relative = os.path.relpath(path, mount["mountPath"])
    items = volume["configMap"].get("items")
    if items:
        relative = next(i["key"] for i in items if i["path"] == relative)
    return config_map["data"][relative]


def config_map_toml(docs, spec, container):
    """The TOML a daemon container's --config names, from the ConfigMap mounted there."""
    args = container.get("args", [])
    if "--config" not in args:
        return None, None
    path = args[args.index("--config") + 1]
    return path, config_map_file(docs, spec, container, path)


def effective_options(docs, spec, container):
    """The daemon's options as its args and --config file give them: {flag: [values]}."""
    options = {}
    _, text = config_map_toml(docs, spec, container)
    if text is not None:
        for key, value in tomllib.loads(text).items():
            values = value if isinstance(value, list) else [value]
            options[f"--{key}"] = [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
    args = container.get("args", [])
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag.startswith("--"), f"{flag!r}: daemon args are --flags and their values"
        if flag == "--keep-segments":
            options[flag] = ["true"]
            i += 1
            continue
        options.setdefault(flag, [])
        if flag in ("--allow-uid", "--allow-gid", "--cuda-pool"):
            options[flag].append(args[i + 1])  # repeatable: the file's and the flags' add up
        else:
            options[flag] = [args[i + 1]]
        i += 2
    return options


# ---------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("path", manifest_files(), ids=os.path.basename)
def test_manifest_parses_and_matches_the_schema(path):
    docs = documents(path)
    assert docs, f"{path}: no YAML document"
    for doc in docs:
        # Strict: a misspelt or misplaced field fails, not only a wrong type.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_pod_spec_has_a_daemon_or_reaches_one():
    specs = pod_specs()
    assert len(specs) >= 3, specs
    with_daemon = [where for where, spec, _ in specs if daemon_container(spec)]
    assert any("sidecar.yaml" in w for w in with_daemon), with_daemon
    assert any("DaemonSet" in w for w in with_daemon), with_daemon


@pytest.mark.parametrize("where,spec,docs", daemon_specs(), ids=DAEMON_IDS)
def test_probes_exec_tensorshmctl_health(where, spec, docs):
    daemon = daemon_container(spec)
    probes = ["readinessProbe", "livenessProbe"] + (["startupProbe"] if "startupProbe" in daemon
                                                    else [])
    for probe in probes:
        assert daemon[probe]["exec"]["command"] == HEALTH, f"{where}: {probe}"
        # The kubelet's default is 1 s: too short for the command's own timeout to speak first.
        assert daemon[probe].get("timeoutSeconds", 1) > HEALTH_TIMEOUT_SECONDS, f"{where}: {probe}"
    # tensorshmctl finds the daemon through TENSORSHM_SOCKET in the container's environment.
    assert env_value(daemon, SOCKET_ENV), f"{where}: the probes need {SOCKET_ENV}"


@pytest.mark.parametrize("where,spec,docs", pod_specs(), ids=[w for w, _, _ in pod_specs()])
def test_socket_volume_is_shared_at_the_same_path(where, spec, docs):
    """Every container that talks to the daemon mounts the socket's directory at the same path
    and names the same socket; in a DaemonSet, client Pods mount the same host directory."""
    daemon = daemon_container(spec)
    containers = ([daemon] if daemon else []) + client_containers(spec)
    sockets = {env_value(c, SOCKET_ENV) for c in containers}
    assert len(sockets) == 1 and None not in sockets, f"{where}: {SOCKET_ENV} differs: {sockets}"
    socket_dir = os.path.dirname(sockets.pop())
    volumes = {v["name"]: v for v in spec["volumes"]}
    sources = set()
    for c in containers:
        mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == socket_dir]
        assert mounts, f"{where}: {c['name']} does not mount {socket_dir}"
        volume = volumes[mounts[0]["name"]]
        if "emptyDir" in volume:
            sources.add(("emptyDir", volume["name"]))
        else:
            assert "hostPath" in volume, f"{where}: {volume['name']} is neither emptyDir nor hostPath"
            sources.add(("hostPath", volume["hostPath"]["path"]))
    assert len(sources) == 1, f"{where}: containers reach the socket through {sources}"
    if daemon and client_containers(spec):
        # A sidecar: the daemon's container and the app's share one volume.
        assert next(iter(sources))[0] == "emptyDir", where
    if daemon is None:
        # A client Pod: the host directory a DaemonSet's daemon serves in.
        served = set()
        for other, other_spec, _ in pod_specs():
            d = daemon_container(other_spec)
            if d and "DaemonSet" in other:
                for v in other_spec["volumes"]:
                    if "hostPath" in v:
                        served.add(("hostPath", v["hostPath"]["path"]))
        assert sources <= served, f"{where}: {sources} is no DaemonSet's socket directory {served}"


@pytest.mark.parametrize("where,spec,docs", daemon_specs(), ids=DAEMON_IDS)
def test_socket_directory_is_made_acceptable_to_the_daemon(where, spec, docs):
    """An emptyDir (0777, not sticky) and a new hostPath (root 0755) both fail the daemon's
    socket-directory rules: an init container fixes the mode before the daemon starts."""
    daemon = daemon_container(spec)
    socket_dir = os.path.dirname(env_value(daemon, SOCKET_ENV))
    init = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") != "Always"
            and any(m["mountPath"] == socket_dir for m in c.get("volumeMounts", []))]
    assert init, f"{where}: nothing prepares {socket_dir} for the daemon"
    command = " ".join(init[0]["command"])
    assert re.search(rf"chmod (1777|0711) {socket_dir}", command), command
    # The init container comes before the daemon (a native sidecar starts in list order).
    names = [c["name"] for c in spec.get("initContainers", [])]
    if daemon["name"] in names:
        assert names.index(init[0]["name"]) < names.index(daemon["name"]), names


@pytest.mark.parametrize("where,spec,docs", pod_specs(), ids=[w for w, _, _ in pod_specs()])
def test_containers_are_locked_down(where, spec, docs):
    daemon = daemon_container(spec)
    for c in ([daemon] if daemon else []) + app_containers(spec):
        name = f"{where}: {c['name']}"
        assert security(spec, c, "runAsNonRoot") is True, name
        assert security(spec, c, "runAsUser") not in (None, 0), name
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        assert not c["securityContext"]["capabilities"].get("add"), name
        assert "memory" in c["resources"]["limits"], name
    # The one root step: an init container with no capability but CHOWN, nothing to escalate to.
    for c in spec.get("initContainers", []):
        if c.get("restartPolicy") == "Always":
            continue
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert set(sc["capabilities"].get("add", [])) <= {"CHOWN"}, c["name"]
    assert not spec.get("hostIPC") and not spec.get("hostNetwork"), where


@pytest.mark.parametrize("where,spec,docs", daemon_specs(), ids=DAEMON_IDS)
def test_dev_shm_and_memory_limit_count_the_pool(where, spec, docs):
    daemon = daemon_container(spec)
    options = effective_options(docs, spec, daemon)
    pool = parse_size(options.get("--host-pool", ["1Gi"])[-1])
    catalog = catalog_bytes(int(options.get("--max-tensors", ["4096"])[-1]))
    limit = parse_size(daemon["resources"]["limits"]["memory"])
    assert limit >= pool + catalog, f"{where}: memory limit {limit} < pool {pool} + catalog"
    if options.get("--segments", ["shm"])[-1] == "memfd":
        return
    mount = [m for m in daemon["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert mount, f"{where}: shm segments need a /dev/shm sized to the pool"
    volume = next(v for v in spec["volumes"] if v["name"] == mount[0]["name"])
    assert volume["emptyDir"]["medium"] == "Memory", where
    size = parse_size(volume["emptyDir"]["sizeLimit"])
    assert size >= pool + catalog, f"{where}: /dev/shm {size} < pool {pool} + catalog {catalog}"
    # Recovery after a container restart: segments kept under a fixed prefix.
    assert options.get("--keep-segments") == ["true"], where
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,48}", options["--shm-prefix"][-1]), where


@pytest.mark.parametrize("where,spec,docs", pod_specs(), ids=[w for w, _, _ in pod_specs()])
def test_client_uids_are_admitted(where, spec, docs):
    """A client container of another uid is admitted by --allow-uid, or by --allow-gid of its
    primary gid, or it would get PERMISSION_DENIED."""
    daemons = [(s, d, dd) for _, s, dd in pod_specs() for d in [daemon_container(s)] if d]
    own = daemon_container(spec)
    candidates = [(spec, own, docs)] if own else [t for t in daemons
                                                   if any("hostPath" in v for v in t[0]["volumes"])]
    for c in client_containers(spec):
        uid = security(spec, c, "runAsUser")
        gid = security(spec, c, "runAsGroup")
        for d_spec, daemon, d_docs in candidates:
            options = effective_options(d_docs, d_spec, daemon)
            daemon_uid = security(d_spec, daemon, "runAsUser")
            admitted = (uid == daemon_uid or str(uid) in options.get("--allow-uid", [])
                        or str(gid) in options.get("--allow-gid", []))
            assert admitted, f"{where}: {c['name']} (uid {uid}, gid {gid}) is not admitted"


@pytest.mark.parametrize("where,spec,docs", daemon_specs(), ids=DAEMON_IDS)
def test_daemon_args_parse(where, spec, docs, tmp_path):
    """Each flag is one tensorshmd --help lists, and `tensorshmd ARGS --help` (a full parse of
    the arguments that starts nothing) exits 0."""
    daemon = daemon_container(spec)
    flags = known_flags()
    args = list(daemon.get("args", []))
    used = {a.split("=")[0] for a in args if a.startswith("--")}
    _, text = config_map_toml(docs, spec, daemon)
    if text is not None:
        used |= {f"--{k}" for k in tomllib.loads(text)}
    # A pending flag the daemon lacks is left out (with its value), and the rest checked.
    pending = sorted(f for f in used - flags if f in PENDING_FLAGS)
    for flag in pending:
        if flag in args:
            del args[args.index(flag):args.index(flag) + 2]
    unknown = used - flags - set(pending)
    assert not unknown, f"{where}: not tensorshmd flags: {unknown}"
    if "--config" in args:
        config = tmp_path / "tensorshmd.toml"
        config.write_text(text)
        args[args.index("--config") + 1] = str(config)
    result = subprocess.run([daemon_binary()] + args + ["--help"], capture_output=True, text=True)
    assert result.returncode == 0, f"{where}: tensorshmd {' '.join(args)}: {result.stderr}"
    if pending:
        pytest.skip(f"{where}: the other flags parse, but {daemon_binary()} does not list "
                    f"{', '.join(pending)} yet: " + "; ".join(PENDING_FLAGS[f] for f in pending))


# ---------------------------------------------------------------- systemd


def unit_entries(path):
    entries = {}
    section = None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            entries.setdefault((section, key), []).append(value)
    return entries


UNIT = os.path.join(SYSTEMD_DIR, "tensorshmd.service")


def test_systemd_unit_keeps_what_recovery_needs():
    entries = unit_entries(UNIT)
    get = lambda key: entries.get(("Service", key), [None])[-1]
    assert get("Type") in ("simple", "exec")
    assert get("User") == "tensorshm" and get("Group") == "tensorshm"
    assert get("DynamicUser") in (None, "no"), "DynamicUser= changes the uid and removes IPC"
    assert get("RemoveIPC") in (None, "no"), "RemoveIPC=yes deletes the kept segments"
    assert get("RuntimeDirectory") == "tensorshm"
    assert get("Restart") == "on-failure"
    exec_start = get("ExecStart").split()
    assert exec_start[0] == "/usr/local/bin/tensorshmd"
    assert "--keep-segments" in exec_start
    prefix = exec_start[exec_start.index("--shm-prefix") + 1]
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,48}", prefix), prefix
    socket = exec_start[exec_start.index("--socket") + 1]
    assert os.path.dirname(socket) == "/run/tensorshm", "the socket lies in RuntimeDirectory="
    # The sysusers.d entry creates the same user, as a system user (logind's RemoveIPC= spares
    # system users only).
    with open(os.path.join(SYSTEMD_DIR, "tensorshm.sysusers.conf")) as f:
        users = [l.split() for l in f if l.strip() and not l.startswith("#")]
    assert ["u", "tensorshm", "-"] == users[0][:3]


def test_systemd_unit_flags_are_daemon_flags(tmp_path):
    exec_start = unit_entries(UNIT)[("Service", "ExecStart")][-1].split()
    used = {a for a in exec_start[1:] if a.startswith("--")}
    unknown = used - known_flags()
    assert not unknown, f"not tensorshmd flags: {unknown}"
    args = exec_start[1:]
    args[args.index("--config") + 1] = os.path.join(SYSTEMD_DIR, "tensorshmd.toml")
    result = subprocess.run([daemon_binary()] + args + ["--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd; scripts/setup.sh "
                    "does)")
    # The unit as installed, with ExecStart pointing at the daemon built here.
    with open(UNIT) as f:
        text = f.read().replace("/usr/local/bin/tensorshmd", daemon_binary())
    unit = tmp_path / "tensorshmd.service"
    unit.write_text(text)
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    # Unknown keys and bad values are only warnings there: any message fails the test too.
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


# ---------------------------------------------------------------- TOML configs


def toml_configs():
    found = [(os.path.join("deploy/systemd", f), open(os.path.join(SYSTEMD_DIR, f)).read())
             for f in sorted(os.listdir(SYSTEMD_DIR)) if f.endswith(".toml")]
    for path in manifest_files():
        for doc in documents(path):
            if doc["kind"] == "ConfigMap":
                for key, text in doc["data"].items():
                    if key.endswith(".toml"):
                        found.append((f"{os.path.basename(path)}: {key}", text))
    return found


@pytest.mark.parametrize("where,text", toml_configs(), ids=[w for w, _ in toml_configs()])
def test_toml_config_keys_are_daemon_flags(where, text, tmp_path):
    config = tomllib.loads(text)
    assert config, where
    flags = known_flags()
    unknown = {f"--{k}" for k in config} - flags
    assert not unknown, f"{where}: keys that are no flag: {unknown}"
    for key, value in config.items():
        if key in ("host-pool", "segment-size", "session-quota", "uid-quota", "cuda-segment-size"):
            # The daemon refuses a size without a unit (a bare number once meant bytes).
            assert re.fullmatch(r"\d+([KMGT]i?B?|B)", str(value)) or value in ("0", 0), \
                f"{where}: {key} = {value!r} needs a unit (Mi, Gi, ...)"
            parse_size(value)
    assert "--config" in flags, "tensorshmd has no --config"
    path = tmp_path / "config.toml"
    path.write_text(text)
    result = subprocess.run([daemon_binary(), "--config", str(path), "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"{where}: {result.stderr}"
