#!/usr/bin/env python3
"""Builds a Dockerfile's stages for real in debootstrapped Debian chroots, without a Docker engine.

Used by tests/container/test-container.sh (`make test-container`), which runs it as root in a
private mount namespace. Each stage starts from a fresh copy of a minbase debootstrap of bookworm
(what the official debian:bookworm and debian:bookworm-slim images are made from); its RUN steps
run in the chroot with the stage's ENV, ARG, WORKDIR and USER; COPY takes files from the build
context (less .dockerignore) or, with --from, from an earlier stage's root. The image configuration
(ENTRYPOINT, CMD, HEALTHCHECK, ...) is collected for the caller to run.

Layer cache: the root of a stage after its steps up to the first COPY (the package installs) is
kept as a tarball keyed by those steps' text, as Docker's layer cache would, so a rerun skips them.
"""

import ctypes
import fnmatch
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time



def host_debian_mirror() -> str:
    """The Debian archive this machine's apt uses (deb822 .sources or sources.list): the
    chroots fetch from where the host already does. TSM_DEBIAN_MIRROR overrides it."""
    if os.environ.get("TSM_DEBIAN_MIRROR"):
        return os.environ["TSM_DEBIAN_MIRROR"]
    candidates = []
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        with open(path) as f:
            for line in f:
                if line.startswith("URIs:"):
                    candidates += line.split()[1:]
    for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 3 and fields[0] == "deb":
                        candidates.append(fields[2] if fields[1].startswith("[") else fields[1])
    for uri in candidates:
        if uri.rstrip("/").endswith("/debian"):  # the main archive, not -security or others
            return uri
    sys.exit("test-container: no Debian archive in /etc/apt's sources; set TSM_DEBIAN_MIRROR")


MIRROR = host_debian_mirror()
SUITE = "bookworm"
# The images the official ones are built from (debuerreotype: a minbase debootstrap; -slim drops
# documentation, which changes nothing a build or the daemon uses).
BASE_IMAGES = {"debian:bookworm": SUITE, "debian:bookworm-slim": SUITE}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SUPPORTED = {"FROM", "ARG", "ENV", "WORKDIR", "RUN", "COPY", "USER", "VOLUME", "ENTRYPOINT", "CMD",
             "HEALTHCHECK", "STOPSIGNAL", "LABEL", "EXPOSE"}

_started = time.monotonic()


def step(message):
    print(f"[{time.monotonic() - _started:7.1f}s] {message}", flush=True)


class BuildError(Exception):
    pass


def run(argv, **kwargs):
    """Runs argv, raising BuildError with its output's tail if it fails."""
    result = subprocess.run(argv, **kwargs)
    if result.returncode != 0:
        raise BuildError(f"{shlex.join(argv)} exited {result.returncode}")
    return result


# ---------------------------------------------------------------- Dockerfile parsing


class Instruction:
    def __init__(self, keyword, args, line):
        self.keyword = keyword
        self.args = args
        self.line = line

    def text(self):
        return f"{self.keyword} {self.args}"


def parse_dockerfile(path):
    instructions = []
    logical, start = "", 0
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            stripped = raw.strip()
            # Comment lines are dropped, even between continued lines (as Docker does).
            if stripped.startswith("#") or (not stripped and not logical):
                continue
            if not logical:
                start = number
            if stripped.endswith("\\"):
                logical += stripped[:-1] + " "
                continue
            logical += stripped
            keyword, _, args = logical.strip().partition(" ")
            keyword = keyword.upper()
            if keyword not in SUPPORTED:
                raise BuildError(f"{path}:{start}: {keyword} is not supported by this interpreter; "
                                 f"use one of {', '.join(sorted(SUPPORTED))}")
            instructions.append(Instruction(keyword, args.strip(), start))
            logical = ""
    if logical:
        raise BuildError(f"{path}: ends inside a continued line")
    return instructions


def substitute(text, variables):
    """Docker's $VAR, ${VAR} and ${VAR:-default} in ENV, WORKDIR, COPY, USER, ..."""

    def replace(match):
        name = match.group(1) or match.group(2)
        default = match.group(3)
        value = variables.get(name, "")
        if default is not None and not value:
            return default
        return value

    return re.sub(r"\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\})",
                  replace, text)


def split_flags(args):
    """Leading --name=value flags of COPY / HEALTHCHECK, and the rest."""
    flags = {}
    rest = args
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, _, value = word[2:].partition("=")
        flags[name] = value
        rest = rest.lstrip()
    return flags, rest


def command_form(args):
    """Exec form (a JSON array) as a list; shell form as ["/bin/sh", "-c", text]."""
    if args.startswith("["):
        try:
            value = json.loads(args)
        except json.JSONDecodeError as e:
            raise BuildError(f"not a JSON array: {args}: {e}")
        if not all(isinstance(v, str) for v in value):
            raise BuildError(f"exec form must hold strings only: {args}")
        return value
    return ["/bin/sh", "-c", args]


def key_values(args, variables):
    """ENV/LABEL/ARG: KEY=VALUE pairs (shell-quoted), or the legacy `KEY VALUE`."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return [(words[0], substitute(" ".join(words[1:]), variables))]
    pairs = []
    for word in words:
        key, _, value = word.partition("=")
        pairs.append((key, substitute(value, variables)))
    return pairs


# ---------------------------------------------------------------- root file systems


def resolve_in_root(root, path):
    """Host path of `path` inside `root`, following symbolic links as the chroot would."""
    parts = [p for p in path.split("/") if p]
    resolved = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root, *resolved, part)
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                raise BuildError(f"too many symbolic links in {path}")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        resolved.append(part)
    return os.path.join(root, *resolved)


def ensure_base_tarball(cache):
    tarball = os.path.join(cache, f"{SUITE}-minbase.tar")
    if os.path.exists(tarball):
        step(f"base: cached debootstrap tarball {tarball}")
        return tarball
    os.makedirs(cache, exist_ok=True)
    partial = tarball + ".partial"
    scratch = os.path.join(cache, "make-tarball")
    shutil.rmtree(scratch, ignore_errors=True)
    step(f"base: debootstrap --variant=minbase --make-tarball {SUITE} from {MIRROR}")
    run(["debootstrap", "--variant=minbase", f"--make-tarball={partial}", SUITE, scratch, MIRROR],
        stdout=subprocess.DEVNULL)
    shutil.rmtree(scratch, ignore_errors=True)
    os.rename(partial, tarball)
    return tarball


def ensure_base_root(cache):
    """An unpacked minbase root, made once and copied for every stage."""
    root = os.path.join(cache, f"{SUITE}-minbase-root")
    done = root + ".complete"
    if os.path.exists(done):
        step(f"base: cached root {root}")
        return root
    tarball = ensure_base_tarball(cache)
    shutil.rmtree(root, ignore_errors=True)
    step(f"base: debootstrap --unpack-tarball into {root}")
    run(["debootstrap", "--variant=minbase", f"--unpack-tarball={tarball}", SUITE, root, MIRROR],
        stdout=subprocess.DEVNULL)
    # As the official images do: no service starts during package installs.
    with open(os.path.join(root, "usr/sbin/policy-rc.d"), "w") as f:
        f.write("#!/bin/sh\nexit 101\n")
    os.chmod(os.path.join(root, "usr/sbin/policy-rc.d"), 0o755)
    open(done, "w").close()
    return root


def inject_host_trust(root):
    """Where the host reaches the network through a TLS-inspecting proxy, its extra CA
    certificates (/usr/local/share/ca-certificates) and pip's configuration (/etc/pip.conf) are
    what a build on this host needs too, as an engine's build would be configured here: they are
    copied into the stage before each RUN. The images' own steps are unchanged."""
    copied = []
    source = "/usr/local/share/ca-certificates"
    if os.path.isdir(source):
        target = os.path.join(root, "usr/local/share/ca-certificates")
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(source):
            if name.endswith(".crt"):
                shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
                copied.append(os.path.join(source, name))
    if os.path.exists("/etc/pip.conf"):
        shutil.copyfile("/etc/pip.conf", os.path.join(root, "etc/pip.conf"))
        copied.append("/etc/pip.conf")
    return copied


def remove_host_trust(root):
    """Takes out what inject_host_trust put in, so the stage's root is the image's own."""
    source = "/usr/local/share/ca-certificates"
    if os.path.isdir(source):
        for name in os.listdir(source):
            path = os.path.join(root, "usr/local/share/ca-certificates", name)
            if os.path.exists(path):
                os.remove(path)
    if os.path.exists("/etc/pip.conf") and os.path.exists(os.path.join(root, "etc/pip.conf")):
        os.remove(os.path.join(root, "etc/pip.conf"))


class Mounts:
    """What a container gets from its engine: /proc, a minimal /dev, /dev/shm, /sys read-only."""

    DEVICES = ["null", "zero", "full", "random", "urandom", "tty"]

    def __init__(self):
        self.points = []

    def mount(self, argv, target):
        if not os.path.lexists(target):
            os.makedirs(target)
        run(["mount"] + argv + [target])
        self.points.append(target)

    def container(self, root, shm_size="64m"):
        self.mount(["-t", "proc", "proc"], os.path.join(root, "proc"))
        self.mount(["-t", "sysfs", "-o", "ro", "sysfs"], os.path.join(root, "sys"))
        dev = os.path.join(root, "dev")
        self.mount(["-t", "tmpfs", "-o", "mode=0755,nosuid", "tmpfs"], dev)
        for name in self.DEVICES:
            node = os.path.join(dev, name)
            open(node, "w").close()
            self.mount(["--bind", f"/dev/{name}"], node)
        for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]:
            os.symlink(target, os.path.join(dev, name))
        self.mount(["-t", "tmpfs", "-o", f"mode=1777,nosuid,nodev,size={shm_size}", "shm"],
                   os.path.join(dev, "shm"))

    def unmount_all(self):
        for target in reversed(self.points):
            subprocess.run(["umount", "-l", target], stderr=subprocess.DEVNULL)
        self.points = []


def lookup_user(root, spec):
    """USER name|uid[:group|gid] -> (uid, gid, home), from the root's /etc/passwd and /etc/group."""
    user, _, group = spec.partition(":")
    passwd = {}
    with open(os.path.join(root, "etc/passwd")) as f:
        for line in f:
            fields = line.rstrip("\n").split(":")
            if len(fields) >= 7:
                passwd[fields[0]] = (int(fields[2]), int(fields[3]), fields[5])
    by_uid = {v[0]: v for v in passwd.values()}
    if user.isdigit():
        uid = int(user)
        entry = by_uid.get(uid)
        gid, home = (entry[1], entry[2]) if entry else (0, "/")
    elif user in passwd:
        uid, gid, home = passwd[user]
    else:
        raise BuildError(f"USER {spec}: no user {user} in the image's /etc/passwd")
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            with open(os.path.join(root, "etc/group")) as f:
                groups = {l.split(":")[0]: int(l.split(":")[2]) for l in f if l.count(":") >= 3}
            if group not in groups:
                raise BuildError(f"USER {spec}: no group {group} in the image's /etc/group")
            gid = groups[group]
    return uid, gid, home


CAPABILITIES = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "SETGID": 6, "SETUID": 7}
_libc = ctypes.CDLL(None, use_errno=True)
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38


def _enter(root, cwd, uid, gid, keep_caps, no_new_privs):
    """In the child, before exec: the container's view (root, working directory), capabilities
    limited to keep_caps (None: unchanged), then the user."""

    def enter():
        os.chroot(root)
        os.chdir("/")
        if keep_caps is not None:
            with open("/proc/sys/kernel/cap_last_cap") as f:
                last = int(f.read())
            keep = {CAPABILITIES[c] for c in keep_caps}
            for cap in range(last + 1):
                if cap not in keep and _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")
        if no_new_privs and _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        os.chdir(cwd)

    return enter


def spawn(root, argv, env, user=(0, 0), cwd="/", keep_caps=None, no_new_privs=False, **kwargs):
    """Starts argv in root as user (uid, gid) with exactly env (a Popen)."""
    uid, gid = user
    return subprocess.Popen(list(argv), env=env,
                            preexec_fn=_enter(root, cwd, uid, gid, keep_caps, no_new_privs),
                            **kwargs)


def run_in(root, argv, env, user=(0, 0), cwd="/", check=True, **kwargs):
    """Runs argv in root as user; its exit status (BuildError if check and not 0)."""
    process = spawn(root, argv, env, user, cwd, **kwargs)
    rc = process.wait()
    if check and rc != 0:
        raise BuildError(f"{shlex.join(argv)} (uid {user[0]}) exited {rc}")
    return rc


# ---------------------------------------------------------------- .dockerignore and COPY


def read_dockerignore(context):
    patterns = []
    path = os.path.join(context, ".dockerignore")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    patterns.append(line)
    return patterns


def ignored(relative, patterns):
    """Docker's rule: the last matching pattern wins; `!` re-includes; a match on a directory
    excludes everything under it."""
    result = False
    parts = relative.split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern[1:] if negate else pattern
        pattern = pattern.strip("/")
        # A pattern matches the path or any of its leading directories.
        for n in range(1, len(parts) + 1):
            prefix = "/".join(parts[:n])
            if pattern.startswith("**/"):
                matched = any(fnmatch.fnmatchcase("/".join(parts[i:n]), pattern[3:])
                              for i in range(n))
            else:
                matched = fnmatch.fnmatchcase(prefix, pattern) and prefix.count("/") == pattern.count("/")
            if matched:
                result = not negate
                break
    return result


def copy_entry(source, dest, owner, filter_relative=None, relative=""):
    """Copies file, link or directory `source` to host path `dest` (inside a root), owned by
    `owner` (uid, gid); modes kept."""
    if filter_relative is not None and relative and filter_relative(relative):
        return
    st = os.lstat(source)
    if os.path.islink(source):
        if os.path.lexists(dest):
            os.remove(dest)
        os.symlink(os.readlink(source), dest)
    elif os.path.isdir(source):
        if not os.path.isdir(dest):
            os.makedirs(dest, exist_ok=True)
            os.chmod(dest, st.st_mode & 0o7777)
        for name in sorted(os.listdir(source)):
            copy_entry(os.path.join(source, name), os.path.join(dest, name), owner,
                       filter_relative, f"{relative}/{name}" if relative else name)
    else:
        if os.path.lexists(dest) and not os.path.isdir(dest):
            os.remove(dest)
        shutil.copy2(source, dest, follow_symlinks=False)
    os.lchown(dest, *owner)


# ---------------------------------------------------------------- stages


class Stage:
    def __init__(self, name, base, index):
        self.name = name
        self.base = base
        self.index = index
        self.root = None
        self.env = {"PATH": DEFAULT_PATH}
        self.args = {}
        self.workdir = "/"
        self.user = "0"
        self.labels = {}
        self.config = {"Entrypoint": None, "Cmd": None, "Healthcheck": None, "StopSignal": None,
                       "Volumes": [], "ExposedPorts": []}
        self.instructions = []


def split_stages(instructions):
    stages = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.args.split()
            if any(w.startswith("--") for w in words):
                raise BuildError(f"line {ins.line}: FROM flags are not supported")
            image = words[0]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, image, len(stages)))
        elif not stages:
            if ins.keyword != "ARG":
                raise BuildError(f"line {ins.line}: {ins.keyword} before the first FROM")
        else:
            stages[-1].instructions.append(ins)
    return stages


class Builder:
    def __init__(self, dockerfile, context, cache, work, use_cache=True):
        self.dockerfile = dockerfile
        self.context = context
        self.cache = cache
        self.work = work
        self.use_cache = use_cache
        self.stages = {}
        self.ignore = read_dockerignore(context)

    def run_env(self, stage, home):
        env = dict(stage.args)
        env.update(stage.env)
        env.setdefault("HOME", home)
        env.setdefault("HOSTNAME", "tensorshm-build")
        return env

    def layer_key(self, stage, upto):
        digest = hashlib.sha256(stage.base.encode())
        for ins in stage.instructions[:upto]:
            digest.update(b"\0" + ins.text().encode())
        return digest.hexdigest()[:24]

    def build(self):
        instructions = parse_dockerfile(self.dockerfile)
        stages = split_stages(instructions)
        base_root = ensure_base_root(self.cache)
        for stage in stages:
            self.build_stage(stage, base_root)
            self.stages[stage.name] = stage
            self.stages[str(stage.index)] = stage
        return stages

    def build_stage(self, stage, base_root):
        if stage.base in self.stages:
            raise BuildError(f"FROM {stage.base}: stages from stages are not supported")
        if stage.base not in BASE_IMAGES:
            raise BuildError(f"FROM {stage.base}: only {', '.join(BASE_IMAGES)} are known here")
        stage.root = os.path.join(self.work, f"stage-{stage.index}-{stage.name}")
        # The layers up to the first COPY are cached (keyed by their text).
        first_copy = next((i for i, ins in enumerate(stage.instructions) if ins.keyword == "COPY"),
                          len(stage.instructions))
        key = self.layer_key(stage, first_copy)
        layer = os.path.join(self.cache, f"layer-{key}.tar")
        start = 0
        if self.use_cache and os.path.exists(layer):
            step(f"stage {stage.name} (FROM {stage.base}): restoring cached layer {layer} "
                 f"(its first {first_copy} instructions)")
            os.makedirs(stage.root)
            run(["tar", "-C", stage.root, "--numeric-owner", "-xpf", layer])
            start = first_copy
        else:
            step(f"stage {stage.name} (FROM {stage.base}): fresh copy of the minbase root")
            run(["cp", "-a", base_root, stage.root])
        mounts = Mounts()
        try:
            mounts.container(stage.root)
            for i, ins in enumerate(stage.instructions):
                if i == first_copy and start == 0 and self.use_cache and first_copy > 0:
                    self.save_layer(stage, mounts, layer)
                self.apply(stage, ins, execute=i >= start)
            if first_copy == len(stage.instructions) and start == 0 and self.use_cache:
                self.save_layer(stage, mounts, layer)
            remove_host_trust(stage.root)
        finally:
            mounts.unmount_all()

    def save_layer(self, stage, mounts, layer):
        step(f"stage {stage.name}: caching its package layer as {layer}")
        excludes = ["--exclude=./proc/*", "--exclude=./sys/*", "--exclude=./dev/*"]
        run(["tar", "-C", stage.root, "--numeric-owner"] + excludes + ["-cf", layer + ".partial",
                                                                         "."])
        os.rename(layer + ".partial", layer)

    def apply(self, stage, ins, execute=True):
        variables = dict(stage.args)
        variables.update(stage.env)
        keyword = ins.keyword
        shown = ins.text() if len(ins.text()) < 200 else ins.text()[:197] + "..."
        if keyword == "ARG":
            for key, value in key_values(ins.args, variables):
                stage.args[key] = value
        elif keyword == "ENV":
            for key, value in key_values(ins.args, variables):
                stage.env[key] = value
        elif keyword == "LABEL":
            for key, value in key_values(ins.args, variables):
                stage.labels[key] = value
        elif keyword == "WORKDIR":
            path = substitute(ins.args, variables)
            stage.workdir = os.path.normpath(os.path.join(stage.workdir, path))
            if execute:
                os.makedirs(resolve_in_root(stage.root, stage.workdir), exist_ok=True)
        elif keyword == "USER":
            stage.user = substitute(ins.args, variables)
        elif keyword == "VOLUME":
            value = ins.args
            stage.config["Volumes"] += (json.loads(value) if value.startswith("[")
                                        else value.split())
        elif keyword == "EXPOSE":
            stage.config["ExposedPorts"] += ins.args.split()
        elif keyword == "STOPSIGNAL":
            stage.config["StopSignal"] = ins.args
        elif keyword == "ENTRYPOINT":
            stage.config["Entrypoint"] = command_form(ins.args)
        elif keyword == "CMD":
            stage.config["Cmd"] = command_form(ins.args)
        elif keyword == "HEALTHCHECK":
            flags, rest = split_flags(ins.args)
            if rest.upper() == "NONE":
                stage.config["Healthcheck"] = None
            else:
                word, _, command = rest.partition(" ")
                if word.upper() != "CMD":
                    raise BuildError(f"line {ins.line}: HEALTHCHECK needs CMD or NONE")
                stage.config["Healthcheck"] = {"Test": command_form(command.strip()),
                                               "Options": flags}
        elif keyword == "RUN":
            if not execute:
                step(f"stage {stage.name}: cached: {shown}")
                return
            step(f"stage {stage.name}: {shown}")
            uid, gid, home = lookup_user(stage.root, stage.user)
            # Docker gives RUN the host's resolver configuration.
            shutil.copyfile("/etc/resolv.conf", os.path.join(stage.root, "etc/resolv.conf"))
            copied = inject_host_trust(stage.root)
            if copied and not getattr(stage, "trust_shown", False):
                step(f"stage {stage.name}: the host's network trust for RUN: {', '.join(copied)}")
                stage.trust_shown = True
            run_in(stage.root, command_form(ins.args), self.run_env(stage, home), (uid, gid),
                   stage.workdir)
        elif keyword == "COPY":
            if not execute:
                return
            step(f"stage {stage.name}: {shown}")
            self.copy(stage, ins, variables)

    def copy(self, stage, ins, variables):
        flags, rest = split_flags(ins.args)
        for flag in flags:
            if flag not in ("from", "chown"):
                raise BuildError(f"line {ins.line}: COPY --{flag} is not supported")
        words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        words = [substitute(w, variables) for w in words]
        if len(words) < 2:
            raise BuildError(f"line {ins.line}: COPY needs a source and a destination")
        sources, dest = words[:-1], words[-1]
        owner = (0, 0)
        if "chown" in flags:
            uid, gid, _ = lookup_user(stage.root, flags["chown"])
            owner = (uid, gid)
        if "from" in flags:
            if flags["from"] not in self.stages:
                raise BuildError(f"line {ins.line}: COPY --from={flags['from']}: no such stage")
            source_root = self.stages[flags["from"]].root
            resolve = lambda s: resolve_in_root(source_root, s)
            skip = None
        else:
            context = os.path.realpath(self.context)
            resolve = lambda s: os.path.normpath(os.path.join(context, s.lstrip("/")))
            skip = lambda rel: ignored(rel, self.ignore)
        matches = []
        for source in sources:
            path = resolve(source)
            found = sorted(__import__("glob").glob(path)) if any(c in source for c in "*?[") else (
                [path] if os.path.lexists(path) else [])
            if not found:
                raise BuildError(f"line {ins.line}: COPY source {source} not found")
            matches += found
        if not dest.startswith("/"):
            dest = os.path.join(stage.workdir, dest)
        into_directory = dest.endswith("/") or len(matches) > 1
        dest_host = resolve_in_root(stage.root, dest)
        for match in matches:
            if os.path.isdir(match) and not os.path.islink(match):
                # A directory's contents go into the destination.
                os.makedirs(dest_host, exist_ok=True)
                for name in sorted(os.listdir(match)):
                    relative = None
                    if skip is not None:
                        relative = os.path.relpath(os.path.join(match, name), resolve("."))
                        if skip(relative):
                            continue
                    base_relative = relative
                    copy_entry(os.path.join(match, name), os.path.join(dest_host, name), owner,
                               (lambda rel, base=base_relative: skip(rel)) if skip else None,
                               base_relative or "")
            else:
                target = (os.path.join(dest_host, os.path.basename(match))
                          if into_directory or os.path.isdir(dest_host) else dest_host)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                copy_entry(match, target, owner)
