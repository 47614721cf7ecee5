#!/usr/bin/env bash
# Runs inside a fresh bookworm container (tests/packages/test-packages.sh): `apt-get install` of
# the .deb pulls its runtime dependencies from the Debian archive; the package's tensorshmd
# serves, its unit is installed but not enabled, and a C program built with
# `cc $(pkg-config --cflags --libs tensorshm)` exchanges a tensor with it across two processes.
# Then the packaged daemon as its unit starts it, with the shipped config: a user in the group
# tensorshm runs that C program, tensorshmctl and a Python client (the cp311 wheel in a venv of
# its own) with no setting at all; a user outside the group is refused, told the group.
# $1: the directory holding the .deb, the wheels and the C program (tests/install/c_program).
set -euo pipefail
pkg=$1
say() { echo "deb: $*"; }

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# The compiler and pkg-config are the C user's; the rest is what the package asks for.
apt-get install -y -qq "$pkg"/tensorshm_*_amd64.deb gcc libc6-dev pkg-config >/tmp/apt.log
say "apt-get install ./$(basename "$pkg"/tensorshm_*_amd64.deb) pulled: $(
  sed -n 's/^Unpacking \([^ :]*\).*/\1/p' /tmp/apt.log | grep -E 'grpc|protobuf|absl|spdlog|fmt|httplib' |
    sort | tr '\n' ' ')"
say "installed tensorshm $(dpkg-query -W -f='${Version}' tensorshm)"
if ldd /usr/bin/tensorshmd /usr/bin/tensorshmctl | grep 'not found'; then
  echo "deb: the programs miss the libraries above: a dependency is not declared" >&2
  exit 1
fi
say "$(tensorshmd --version), $(tensorshmctl --version)"

unit=$(dpkg -L tensorshm | grep '/systemd/system/tensorshmd.service$')
grep -q "^ExecStart=/usr/bin/tensorshmd " "$unit" || {
  echo "deb: $unit does not start /usr/bin/tensorshmd:" >&2
  grep '^ExecStart' "$unit" >&2
  exit 1
}
if compgen -G "/etc/systemd/system/*.wants/tensorshmd.service" >/dev/null; then
  echo "deb: the package enabled tensorshmd.service" >&2
  exit 1
fi
say "unit $unit installed, not enabled"

mkdir -m 0700 /run/tsm
tensorshmd --socket /run/tsm/tensorshm.sock --host-pool 64Mi --segments memfd \
  >/run/tsm/daemon.log 2>&1 &
daemon=$!
trap 'kill "$daemon" 2>/dev/null || true; cat /run/tsm/daemon.log' EXIT
for _ in $(seq 100); do
  tensorshmctl --socket /run/tsm/tensorshm.sock --timeout 1s health >/dev/null 2>&1 && break
  sleep 0.1
done
say "tensorshmctl health: $(tensorshmctl --socket /run/tsm/tensorshm.sock --timeout 2s health)"

flags=$(pkg-config --cflags --libs tensorshm)
say "pkg-config --cflags --libs tensorshm: $flags"
# shellcheck disable=SC2086  # the flags are words
cc -Wall -Wextra -Werror -o /tmp/c_program "$pkg"/main.c $flags
produced=$(/tmp/c_program produce /run/tsm/tensorshm.sock pkg/c)
consumed=$(/tmp/c_program consume /run/tsm/tensorshm.sock pkg/c)
say "producer: $produced; consumer (another process): $consumed"
[ -n "$produced" ] && [ "$produced" = "$consumed" ] || {
  echo "deb: the consumer saw other values than the producer published" >&2
  exit 1
}
kill -TERM "$daemon"
wait "$daemon"
trap - EXIT
say "the package's tensorshmd stopped on SIGTERM with status 0"

# The packaged daemon as its unit starts it, with the shipped config (no systemd here: the unit's
# RuntimeDirectory= and User= by hand); a user in the group tensorshm uses it with no setting at
# all, a user outside it is refused and told the group.
getent group tensorshm >/dev/null || { echo "deb: the package made no group tensorshm" >&2; exit 1; }
install -d -o tensorshm -g tensorshm -m 0711 /run/tensorshm
read -r -a exec_start <<<"$(sed -n 's/^ExecStart=//p' "$unit")"
setpriv --reuid=tensorshm --regid=tensorshm --init-groups "${exec_start[@]}" \
  >/tmp/system-daemon.log 2>&1 &
system=$!
trap 'kill "$system" 2>/dev/null || true; cat /tmp/system-daemon.log' EXIT
for _ in $(seq 100); do [ -S /run/tensorshm/tensorshm.sock ] && break; sleep 0.1; done
say "the unit's daemon: ${exec_start[*]} (as user tensorshm)"
useradd --create-home --shell /bin/bash member
usermod -aG tensorshm member
useradd --create-home --shell /bin/bash stranger
as() { local who=$1; shift; su - "$who" -c "$*"; }  # a new login: groups from /etc/group
say "member, no settings: tensorshmctl health: $(as member tensorshmctl health)"
produced=$(as member /tmp/c_program produce "''" sys/c)
consumed=$(as member /tmp/c_program consume "''" sys/c)
say "member, no settings: C producer $produced, consumer $consumed"
[ -n "$produced" ] && [ "$produced" = "$consumed" ] || {
  echo "deb: the member's consumer saw other values than its producer published" >&2
  exit 1
}
# Python: the member's own venv with the cp311 wheel (the client only; the system daemon serves).
apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null
wheel=$(ls "$pkg"/tensorshm-*-cp311-cp311-*.whl)
as member "python3 -m venv ~/venv && ~/venv/bin/pip install -q --disable-pip-version-check \
  $wheel numpy"
python_said=$(as member "~/venv/bin/python -c 'import tensorshm, numpy as np
with tensorshm.connect() as c:
    c.put(\"sys/py\", np.arange(5))
    print(c.socket, np.from_dlpack(c.get(\"sys/py\")).tolist())'")
say "member, no settings: Python: $python_said"
[ "$python_said" = "/run/tensorshm/tensorshm.sock [0, 1, 2, 3, 4]" ] || {
  echo "deb: the member's Python client did not use the system daemon as expected" >&2
  exit 1
}
if refused=$(as stranger /tmp/c_program produce "''" sys/x 2>&1); then
  echo "deb: a user outside the group tensorshm was admitted: $refused" >&2
  exit 1
fi
say "stranger: $refused"
case "$refused" in *"members of group tensorshm"*"usermod -aG tensorshm USER"*) ;; *)
  echo "deb: the refusal does not name the group tensorshm and how to join it" >&2
  exit 1
esac
kill -TERM "$system"
wait "$system"
trap - EXIT
rm -f /dev/shm/tsm-system.*  # --keep-segments kept them for a restart
say "PASS"
