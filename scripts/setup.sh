#!/usr/bin/env bash
# Installs what tensorshm needs to build and test: Debian packages and the project virtualenv.
# Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(build-essential cmake pkg-config python3 python3-venv python3-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libboost-dev libabsl-dev libgtest-dev libgmock-dev clang libclang-rt-dev spin
  libcli11-dev libspdlog-dev libtoml11-dev libcpp-httplib-dev nlohmann-json3-dev
  systemd openssl graphviz doxygen iproute2 strace)  # systemd: systemd-analyze and libseccomp, for
  # tests/deploy's unit check; openssl: the movers' mTLS certificates in tests/multinode;
  # graphviz: the architecture picture (make architecture, its test); doxygen: make docs;
  # iproute2: ss, for tests that wait for a connection in a stopped daemon's backlog; strace:
  # tests/python/test_messages.py counts what a put sends

missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: need root to install packages (run as root or: sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Position-independent static abseil for libtensorshm.so (scripts/pic_abseil.sh says why).
bash scripts/pic_abseil.sh

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$python" -m venv .venv || {
    echo "setup: '$python -m venv' failed; install python3-venv" >&2
    exit 1
  }
fi
if ! .venv/bin/python -c 'import tvm_ffi, nanobind, scikit_build_core, numpy, ml_dtypes, pytest
import prometheus_client, yaml, kubernetes_validate' \
    2>/dev/null || [ ! -x .venv/bin/tvm-ffi-config ]; then
  echo "setup: installing Python packages into .venv"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -r scripts/requirements.txt
fi
