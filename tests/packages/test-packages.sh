#!/usr/bin/env bash
# `make test-packages`: installs dist/'s wheels and .deb (made by `make wheels deb`) for real, each
# in a fresh container of its own (buildah, from tests/container/base-images.sh's images):
# wheel_scenario.sh as a user with only python3 and python3-venv, with the cp311 wheel on Debian
# bookworm (Python 3.11) and the cp312-abi3 wheel on Debian trixie (Python 3.13);
# deb_scenario.sh with apt on bookworm. Prints each wheel's size, tag and the libraries it
# vendors first. Needs root and the network
# (Debian's archive in both containers, PyPI for numpy). The containers are removed on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { echo "test-packages: $*"; }

one() {  # the one file matching a pattern, or a failure naming what to run
  local matches=()
  for f in $1; do [ -e "$f" ] && matches+=("$f"); done
  [ ${#matches[@]} -eq 1 ] || {
    echo "test-packages: want exactly one $1, found ${#matches[@]} (run make wheels deb)" >&2
    exit 1
  }
  echo "${matches[0]}"
}
bookworm_wheel=$(one "dist/tensorshm-*-cp311-cp311-*.whl")
trixie_wheel=$(one "dist/tensorshm-*-cp312-abi3-*.whl")
deb=$(one "dist/tensorshm_*_amd64.deb")

for wheel in "$bookworm_wheel" "$trixie_wheel"; do
  tag=$(basename "$wheel" .whl | cut -d- -f3-)
  say "wheel $(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB, tag $tag"
  say "vendored by auditwheel (tensorshm.libs/):"
  python3 -c 'import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
libs = sorted(n.split("/", 1)[1] for n in names if n.startswith("tensorshm.libs/") and n[15:])
print("\n".join("  " + n for n in libs))
print(f"  ({len(libs)} libraries)")' "$wheel"
done
say "deb $(basename "$deb"): $(du -k "$deb" | cut -f1) KiB; Depends: $(dpkg-deb -f "$deb" Depends)"

bash tests/container/base-images.sh
bash tests/container/base-images.sh trixie
source tests/container/buildah-storage.sh

stage=$(mktemp -d)
containers=()
cleanup() {
  for c in "${containers[@]}"; do $BUILDAH rm "$c" >/dev/null 2>&1 || true; done
  rm -rf "$stage"
}
trap cleanup EXIT
cp "$bookworm_wheel" "$trixie_wheel" "$deb" tests/packages/exchange.py \
  tests/packages/*_scenario.sh \
  tests/install/c_program/main.c "$stage"/

run_scenario() {  # NAME SUITE [ARG]: a new container of SUITE's image runs NAME_scenario.sh
  local ctr
  ctr=$($BUILDAH from --pull=never "localhost/debian:$2")
  containers+=("$ctr")
  $BUILDAH copy --quiet "$ctr" "$stage" /pkg
  say "$1 on $2${3:+ ($3)}: in container $ctr"
  $BUILDAH run --isolation chroot --network host "$ctr" -- \
    bash "/pkg/$1_scenario.sh" /pkg ${3:+"$3"}
}
run_scenario wheel bookworm "$(basename "$bookworm_wheel")"
run_scenario wheel trixie "$(basename "$trixie_wheel")"
run_scenario deb bookworm
say "PASS: the wheels (cp311 on bookworm, cp312-abi3 on trixie) and the .deb installed and served"
