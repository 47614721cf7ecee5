#!/usr/bin/env bash
# Runs inside a fresh Debian container (tests/packages/test-packages.sh: bookworm with the cp311
# wheel, trixie with the cp312-abi3 one): a user with only python3 and python3-venv installs the
# wheel file plus numpy from PyPI, then runs the wheel's tensorshmd and tensorshmctl from the
# venv, a producer and a consumer process, and tensorshm.Daemon. $1: the directory holding the
# wheels and this directory's files; $2: the wheel's file name.
set -euo pipefail
pkg=$1
wheel=$pkg/$2
say() { echo "wheel: $*"; }

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null
# Nothing the build needs is on this machine: no -dev package, no gRPC, protobuf or abseil.
if dpkg-query -W -f='${Package}\n' | grep -E -- '-dev$|grpc|protobuf|absl'; then
  echo "wheel: the container has the packages above, which the test must not have" >&2
  exit 1
fi
release=$(. /etc/os-release && echo "$PRETTY_NAME")
say "python3 and python3-venv only: $(python3 --version), $release"

python3 -m venv /opt/tsm
/opt/tsm/bin/pip install -q --disable-pip-version-check "$wheel" numpy
export PATH=/opt/tsm/bin:$PATH
say "installed $(basename "$wheel") and numpy into /opt/tsm"

version=$(tensorshmd --version)
pip_version=$(pip show tensorshm | sed -n 's/^Version: //p')
say "tensorshmd --version: $version; pip show tensorshm: $pip_version"
case "$version" in *"$pip_version"*) ;; *)
  echo "wheel: tensorshmd --version ($version) does not name pip's version $pip_version" >&2
  exit 1
esac

# The venv's daemon, on a socket of its own, with named /dev/shm segments.
mkdir -m 0700 /run/tsm
tensorshmd --socket /run/tsm/tensorshm.sock --host-pool 64Mi --shm-prefix tsm-pkg \
  >/run/tsm/daemon.log 2>&1 &
daemon=$!
stop_daemon() { kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; }
trap stop_daemon EXIT
for _ in $(seq 100); do
  tensorshmctl --socket /run/tsm/tensorshm.sock --timeout 1s health >/dev/null 2>&1 && break
  sleep 0.1
done
say "tensorshmctl health: $(tensorshmctl --socket /run/tsm/tensorshm.sock --timeout 2s health)"
python3 "$pkg"/exchange.py produce /run/tsm/tensorshm.sock pkg/x
python3 "$pkg"/exchange.py consume /run/tsm/tensorshm.sock pkg/x
kill -TERM "$daemon"
wait "$daemon"
trap - EXIT
say "the venv's tensorshmd stopped on SIGTERM with status 0"

# tensorshm.Daemon finds the wheel's tensorshmd by itself (no $TENSORSHMD, no PATH entry).
env -u TENSORSHMD PATH=/usr/bin:/bin /opt/tsm/bin/python - <<'PY'
import os, numpy as np, tensorshm
before = set(os.listdir("/dev/shm"))
with tensorshm.Daemon(host_pool="64Mi") as d, d.connect() as c:
    c.put("x", np.arange(10))
    assert np.from_dlpack(c.get("x")).tolist() == list(range(10))
    print(f"wheel: tensorshm.Daemon served on {d.socket} (pid {d.pid})")
left = set(os.listdir("/dev/shm")) - before
assert not left, f"left in /dev/shm: {sorted(left)}"
print("wheel: tensorshm.Daemon stopped, nothing left in /dev/shm")
PY
say "PASS"
