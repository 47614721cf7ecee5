"""deploy/: the Kubernetes manifests, the systemd unit and the TOML configs, checked against the
Kubernetes schema and against the daemon that is built here (its flags, its sizes).

Every flag a manifest gives the daemon must be one `tensorshmd --help` lists. triton.yaml's Triton, model and client scripts are checked statically (and the
Python model run on a fake Triton module): nothing here runs Triton or a cluster.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types

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
    unknown = used - flags
    assert not unknown, f"{where}: not tensorshmd flags: {unknown}"
    if "--config" in args:
        config = tmp_path / "tensorshmd.toml"
        config.write_text(text)
        args[args.index("--config") + 1] = str(config)
    result = subprocess.run([daemon_binary()] + args + ["--help"], capture_output=True, text=True)
    assert result.returncode == 0, f"{where}: tensorshmd {' '.join(args)}: {result.stderr}"


# ---------------------------------------------------------------- servers that map segments by name


def shm_server_specs():
    """daemon_specs() with a server that opens the daemon's segments by name (Triton)."""
    return [(w, s, d) for w, s, d in daemon_specs() if shm_servers(s)]


SHM_SERVER_IDS = [w for w, _, _ in shm_server_specs()]


def groups(spec, container):
    """The gids a container's processes hold, as the Pod spec sets them (the primary group, the
    Pod's supplementalGroups and fsGroup; the image's /etc/group may add more)."""
    found = set(spec.get("securityContext", {}).get("supplementalGroups", []))
    found.add(security(spec, container, "runAsGroup"))
    found.add(spec.get("securityContext", {}).get("fsGroup"))
    return found - {None}


def mount_of(container, path):
    return next((m for m in container.get("volumeMounts", []) if m["mountPath"] == path), None)


def parse_pbtxt(text):
    """Protobuf text format, the subset model configs use: {field: [values]}, a message value is
    such a dict, `field [a, b]` and repeated `field {...}` both give a list."""
    tokens = re.findall(r'"[^"]*"|[{}\[\]:,]|[^\s{}\[\]:,"]+', re.sub(r"#[^\n]*", "", text))

    def value(i):
        if tokens[i] == "{":
            return message(i + 1)
        if tokens[i] == "[":
            items, i = [], i + 1
            while tokens[i] != "]":
                if tokens[i] == ",":
                    i += 1
                    continue
                item, i = value(i)
                items.append(item)
            return items, i + 1
        token = tokens[i]
        return (token[1:-1] if token.startswith('"') else token), i + 1

    def message(i):
        fields = {}
        while i < len(tokens) and tokens[i] != "}":
            key, i = tokens[i], i + 1
            if tokens[i] == ":":
                i += 1
            item, i = value(i)
            fields.setdefault(key, []).extend(item if isinstance(item, list) else [item])
        return fields, i + 1

    return message(0)[0]


def triton_option(server, name):
    """The value of `--name=VALUE` among a Triton container's command and args (the last one)."""
    values = [a.split("=", 1)[1] for a in server.get("command", []) + server.get("args", [])
              if a.startswith(f"--{name}=")]
    return values[-1] if values else None


def python_backend_option(server, name, default):
    """The integer value of `--backend-config=python,name=VALUE` (the last one), else default."""
    prefix = f"--backend-config=python,{name}="
    values = [a[len(prefix):] for a in server.get("command", []) + server.get("args", [])
              if a.startswith(prefix)]
    return int(values[-1]) if values else default


def triton_models(docs, spec, server):
    """{model name: (config dict, model.py text or None)} of the models Triton is told to load."""
    repository = triton_option(server, "model-repository")
    assert repository, f"{server['name']}: no --model-repository"
    assert triton_option(server, "model-control-mode") == "explicit", \
        "explicit model control: a ConfigMap volume also holds ..data entries, not models"
    names = [a.split("=", 1)[1] for a in server.get("args", []) if a.startswith("--load-model=")]
    assert names, f"{server['name']}: no --load-model"
    models = {}
    for name in names:
        path = f"{repository}/{name}/config.pbtxt"
        config = parse_pbtxt(config_map_file(docs, spec, server, path))
        # Triton requires the config's name to be its directory's.
        assert config["name"] == [name], (name, config["name"])
        source = None
        if config.get("backend") == ["python"]:
            source = config_map_file(docs, spec, server, f"{repository}/{name}/1/model.py")
        models[name] = (config, source)
    return models


def python_client_api():
    """The methods and properties of tensorshm.Client, read from its source (no build needed)."""
    with open(os.path.join(ROOT, "python", "tensorshm", "_client.py")) as f:
        tree = ast.parse(f.read())
    client = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Client")
    return {n.name for n in client.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def client_script(docs, spec, container):
    """The Python source a client container runs (`python3 PATH`), from its ConfigMap."""
    command = container.get("command", []) + container.get("args", [])
    path = next(a for a in command if a.endswith(".py"))
    return config_map_file(docs, spec, container, path)


@pytest.mark.parametrize("where,spec,docs", shm_server_specs(), ids=SHM_SERVER_IDS)
def test_shm_group_is_the_servers_and_nobody_elses(where, spec, docs):
    """Triton opens segments by name, read-write: the daemon makes them 0660 in --shm-group GID,
    Triton holds GID, and so does the daemon (an unprivileged process can give its files only a
    group it is in). Every process in GID can write every host tensor: any other container in
    it must be of the daemon's own uid, which owns the segments anyway."""
    daemon = daemon_container(spec)
    options = effective_options(docs, spec, daemon)
    assert "--shm-group" in options, f"{where}: Triton cannot open segments of mode 0600"
    gid_text = options["--shm-group"][-1]
    assert re.fullmatch(r"[1-9][0-9]*", gid_text), f"{where}: --shm-group {gid_text!r}: a gid"
    gid = int(gid_text)
    assert gid in groups(spec, daemon), f"{where}: tensorshmd is not in group {gid}"
    daemon_uid = security(spec, daemon, "runAsUser")
    servers = shm_servers(spec)
    for server in servers:
        assert gid in groups(spec, server), f"{where}: {server['name']} is not in group {gid}"
        assert security(spec, server, "runAsUser") != daemon_uid, \
            f"{where}: {server['name']} runs as the daemon's uid: no group needed, nothing held"
    for c in app_containers(spec):
        if c in servers or gid not in groups(spec, c):
            continue
        assert security(spec, c, "runAsUser") == daemon_uid, \
            f"{where}: {c['name']} is in group {gid}: it could write every host tensor"
    # fsGroup would also make the volumes (the socket's directory, /dev/shm) group-owned.
    assert "fsGroup" not in spec.get("securityContext", {}), where


@pytest.mark.parametrize("where,spec,docs", shm_server_specs(), ids=SHM_SERVER_IDS)
def test_segments_are_named_objects(where, spec, docs):
    """memfd segments have no name Triton could open: the daemon's --segments is shm, and no
    container passes --segments memfd (the image's CMD does: the daemon needs its own args)."""
    daemon = daemon_container(spec)
    assert "args" in daemon, f"{where}: the image's CMD is --segments memfd"
    assert effective_options(docs, spec, daemon).get("--segments", ["shm"])[-1] == "shm", where
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        words = c.get("command", []) + c.get("args", [])
        pairs = list(zip(words, words[1:]))
        assert ("--segments", "memfd") not in pairs and "--segments=memfd" not in words, \
            f"{where}: {c['name']} passes --segments memfd"


@pytest.mark.parametrize("where,spec,docs", shm_server_specs(), ids=SHM_SERVER_IDS)
def test_clients_create_in_named_segments(where, spec, docs):
    """Only the daemon's uid gets named segments (another uid's are always memfds): every
    client whose tensors a server maps (its inputs, the buffers it writes outputs into) runs as
    the daemon's uid."""
    daemon_uid = security(spec, daemon_container(spec), "runAsUser")
    for c in client_containers(spec):
        assert security(spec, c, "runAsUser") == daemon_uid, \
            f"{where}: {c['name']}'s tensors would be memfds, which Triton cannot open by name"


@pytest.mark.parametrize("where,spec,docs", shm_server_specs(), ids=SHM_SERVER_IDS)
def test_servers_share_the_daemons_dev_shm(where, spec, docs):
    """Triton's shm_open looks in its own /dev/shm: the daemon's volume, mounted there. Made
    sticky before either starts (an emptyDir is 0777 without it), so neither can remove the
    other's objects; sized for the pool, the catalog and Triton's Python backend regions."""
    daemon = daemon_container(spec)
    daemon_mount = mount_of(daemon, "/dev/shm")
    assert daemon_mount, f"{where}: tensorshmd has no /dev/shm volume"
    volume = next(v for v in spec["volumes"] if v["name"] == daemon_mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory", where
    for server in shm_servers(spec):
        mount = mount_of(server, "/dev/shm")
        assert mount and mount["name"] == daemon_mount["name"], \
            f"{where}: {server['name']} does not mount {daemon_mount['name']} at /dev/shm"
        assert not mount.get("readOnly"), f"{where}: {server['name']} opens segments O_RDWR"
    # Clients need the socket (test_socket_volume_is_shared_at_the_same_path), not /dev/shm:
    # they receive segments as descriptors.
    sticky = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") != "Always"
              and mount_of(c, "/dev/shm") and mount_of(c, "/dev/shm")["name"] == volume["name"]
              and re.search(r"chmod 1777( \S+)* /dev/shm\b", " ".join(c.get("command", [])))]
    assert sticky, f"{where}: nothing makes the shared /dev/shm sticky"
    options = effective_options(docs, spec, daemon)
    need = (parse_size(options.get("--host-pool", ["1Gi"])[-1])
            + catalog_bytes(int(options.get("--max-tensors", ["4096"])[-1])))
    for server in shm_servers(spec):
        for config, source in triton_models(docs, spec, server).values():
            if source is None:
                continue
            # One region per model instance, one more while the model loads (auto-complete).
            instance_groups = config.get("instance_group", [{}])
            instances = sum(int(g.get("count", ["1"])[0]) for g in instance_groups)
            need += (instances + 1) * python_backend_option(server, "shm-default-byte-size",
                                                            1 << 20)
    size = parse_size(volume["emptyDir"]["sizeLimit"])
    assert size >= need, f"{where}: /dev/shm {size} < {need} (pool, catalog, Python backend)"


@pytest.mark.parametrize("where,spec,docs", shm_server_specs(), ids=SHM_SERVER_IDS)
def test_triton_is_probed_and_reached_on_its_http_port(where, spec, docs):
    """Startup and readiness wait for the models (/v2/health/ready), liveness for the server;
    the feeder talks to the same port."""
    for server in shm_servers(spec):
        port = int(triton_option(server, "http-port") or 8000)
        assert port in [p["containerPort"] for p in server.get("ports", [])], where
        for probe, path in (("readinessProbe", "/v2/health/ready"),
                            ("startupProbe", "/v2/health/ready"),
                            ("livenessProbe", "/v2/health/live")):
            get = server[probe]["httpGet"]
            assert (get["path"], get["port"]) == (path, port), f"{where}: {probe}"
        for c in client_containers(spec):
            if "tritonclient" in client_script(docs, spec, c):
                assert f"localhost:{port}" in client_script(docs, spec, c), \
                    f"{where}: {c['name']} does not reach Triton's HTTP port {port}"


@pytest.mark.parametrize("where,spec,docs", shm_server_specs(), ids=SHM_SERVER_IDS)
def test_client_scripts_compile_and_feed_the_model_triton_loads(where, spec, docs):
    """The scripts the client containers run (from their ConfigMap) compile and call only
    methods tensorshm.Client has; the feeder uses tensorshm.triton's TritonFeeder and names a
    model Triton loads, with its input and output names."""
    models = {}
    for server in shm_servers(spec):
        models.update(triton_models(docs, spec, server))
    api = python_client_api()
    fed = []
    for c in client_containers(spec):
        source = client_script(docs, spec, c)
        tree = ast.parse(source, filename=c["name"])
        compile(tree, c["name"], "exec")
        # `with tensorshm.connect(...) as NAME`: every NAME.attr is the client's.
        clients = {item.optional_vars.id for n in ast.walk(tree) if isinstance(n, ast.With)
                   for item in n.items if isinstance(item.context_expr, ast.Call)
                   and ast.unparse(item.context_expr.func) == "tensorshm.connect"
                   and isinstance(item.optional_vars, ast.Name)}
        assert clients, f"{where}: {c['name']} does not connect with tensorshm.connect()"
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id in clients}
        assert used <= api, f"{where}: {c['name']}: tensorshm.Client has no {sorted(used - api)}"
        imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   for a in n.names}
        if ("tensorshm.triton", "TritonFeeder") not in imports:
            continue
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)}
        named = [m for m in models if m in strings]
        assert named, f"{where}: {c['name']} names no model Triton loads ({sorted(models)})"
        for name in named:
            config = models[name][0]
            for tensor in config["input"] + config["output"]:
                assert tensor["name"][0] in strings, f"{where}: {c['name']}: {tensor['name']}"
        fed.append(c["name"])
    assert fed, f"{where}: no client feeds Triton through tensorshm.triton.TritonFeeder"


@pytest.mark.parametrize("where,spec,docs", shm_server_specs(), ids=SHM_SERVER_IDS)
def test_python_models_compute_what_their_config_declares(where, spec, docs, monkeypatch):
    """Each Python backend model, run on a fake triton_python_backend_utils: its outputs are
    the config's names and dtypes, and the example model computes y = 2x + 1."""
    numpy = pytest.importorskip("numpy")
    dtypes = {"TYPE_FP32": numpy.float32, "TYPE_FP16": numpy.float16, "TYPE_FP64": numpy.float64,
              "TYPE_INT32": numpy.int32, "TYPE_INT64": numpy.int64}

    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, numpy.asarray(array)

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    utils = types.ModuleType("triton_python_backend_utils")
    utils.Tensor = Tensor
    utils.InferenceResponse = InferenceResponse
    utils.get_input_tensor_by_name = lambda request, name: next(
        (t for t in request if t.name() == name), None)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", utils)
    checked = 0
    for server in shm_servers(spec):
        for name, (config, source) in triton_models(docs, spec, server).items():
            if source is None:
                continue
            namespace = {}
            exec(compile(source, f"{name}/1/model.py", "exec"), namespace)
            model = namespace["TritonPythonModel"]()
            x = numpy.linspace(-4, 4, 17, dtype=numpy.float32)
            request = [Tensor(i["name"][0], x.astype(dtypes[i["data_type"][0]]))
                       for i in config["input"]]
            responses = model.execute([request, request])  # two requests, two responses
            assert len(responses) == 2, name
            for response in responses:
                assert response.error is None, name
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors}
                assert set(outputs) == {o["name"][0] for o in config["output"]}, name
                for o in config["output"]:
                    assert outputs[o["name"][0]].dtype == dtypes[o["data_type"][0]], name
                if name == "affine":
                    numpy.testing.assert_array_equal(outputs["y"], 2 * x + 1)
            checked += 1
    assert checked, f"{where}: no Python backend model to run"


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


def shipped_config(directory) -> str:
    """deploy/systemd/tensorshmd.toml, to run a daemon with: as it is where the group it admits
    (tensorshm, which the .deb makes) exists, else a copy in `directory` that names Debian's
    `nogroup` in its place (a build machine has no such group, and the daemon refuses a group
    name it cannot find)."""
    import grp

    path = os.path.join(SYSTEMD_DIR, "tensorshmd.toml")
    text = open(path).read()
    assert 'allow-gid = ["tensorshm"]' in text, "the shipped config admits the group tensorshm"
    try:
        grp.getgrnam("tensorshm")
        return path
    except KeyError:
        copy = os.path.join(str(directory), "tensorshmd.toml")
        with open(copy, "w") as f:
            f.write(text.replace('allow-gid = ["tensorshm"]', 'allow-gid = ["nogroup"]'))
        os.chmod(copy, 0o644)
        return copy


def test_systemd_unit_flags_are_daemon_flags(tmp_path):
    exec_start = unit_entries(UNIT)[("Service", "ExecStart")][-1].split()
    used = {a for a in exec_start[1:] if a.startswith("--")}
    unknown = used - known_flags()
    assert not unknown, f"not tensorshmd flags: {unknown}"
    args = exec_start[1:]
    args[args.index("--config") + 1] = shipped_config(tmp_path)
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
