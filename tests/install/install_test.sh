#!/usr/bin/env bash
# Installs the build into a scratch prefix, builds tests/install/consumer against it with
# find_package(tensorshm CONFIG), and exchanges a tensor between two processes of that program
# through the installed tensorshmd.
set -euo pipefail
build_dir=$1
consumer_src=$2
cxx_flags=${3:-}
link_flags=${4:-}
work=$(mktemp -d /tmp/tsm-install-test.XXXXXX)
daemon_pid=
cleanup() {
  [ -n "$daemon_pid" ] && kill -TERM "$daemon_pid" 2>/dev/null && wait "$daemon_pid" || true
  rm -rf "$work"
}
trap cleanup EXIT

cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/include/tensorshm/client.h"
test -f "$work/prefix/include/tensorshm/tensorshm.h"
test -f "$work/prefix/include/tensorshm/third_party/dlpack/dlpack.h"
test -x "$work/prefix/bin/tensorshmd"

cmake -S "$consumer_src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_CXX_FLAGS="$cxx_flags" -DCMAKE_EXE_LINKER_FLAGS="$link_flags" >/dev/null
cmake --build "$work/build" -j2 >/dev/null

socket="$work/tensorshm.sock"
"$work/prefix/bin/tensorshmd" --socket "$socket" --host-pool 64Mi --segment-size 16Mi \
  --shm-prefix "tsmtest-install-$$" >"$work/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 200); do
  grep -q "serving on" "$work/daemon.log" && break
  sleep 0.05
done
grep -q "serving on" "$work/daemon.log" || { cat "$work/daemon.log"; exit 1; }

produced=$("$work/build/tensorshm_consumer" produce "$socket" installed/tensor)
consumed=$("$work/build/tensorshm_consumer" consume "$socket" installed/tensor)
echo "producer: $produced"
echo "consumer: $consumed"
[ -n "$produced" ] && [ "$produced" = "$consumed" ]

kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=
echo "install test passed"
