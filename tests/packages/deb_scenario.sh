#!/usr/bin/env bash
# Runs inside a fresh bookworm container (tests/packages/test-packages.sh): `apt-get install` of
# the .deb pulls its runtime dependencies from the Debian archive; the package's tensorshmd
# serves, its unit is installed but not enabled, and a C program built with
# `cc $(pkg-config --cflags --libs tensorshm)` exchanges a tensor with it across two processes.
# $1: the directory holding the .deb and the C program (tests/install/c_program/main.c).
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
say "PASS"
