#!/usr/bin/env bash
# `make test-container`: builds the Dockerfile with buildah (`buildah bud`, chroot isolation, no
# container engine or registry needed) from Debian base images made locally with debootstrap
# (base-images.sh), then runs the image's daemon, HEALTHCHECK command and a client, and the
# Kubernetes manifests' containers, with `buildah run` (tests/container/container_test.py).
# Needs root and the network (Debian's archive, PyPI); installs buildah, debootstrap and
# python3-yaml when missing.
#
# Cached under $TSM_CONTAINER_CACHE (default /var/cache/tensorshm-test-container): the debootstrap
# tarball, and buildah's store with the base images and the build's layers (buildah bud
# --layers), so a rerun repeats only the steps whose inputs changed. Safe to rerun: the test's
# containers are removed at the end (and at the start, if a killed run left any), images the
# rebuild replaced are pruned, and what it mounts lives in a private mount namespace.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/container/buildah-storage.sh

if [ "$(id -u)" -ne 0 ]; then
  echo "test-container: needs root (debootstrap, buildah, mounts)" >&2
  exit 1
fi
if ! dpkg-query -W -f='${Status}' python3-yaml 2>/dev/null | grep -q "install ok installed"; then
  echo "test-container: installing Debian packages: python3-yaml"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends python3-yaml >/dev/null
fi

# What the Dockerfile interpreter that came before buildah cached (an unpacked root, layers).
rm -rf "$TSM_CONTAINER_CACHE"/bookworm-minbase-root* "$TSM_CONTAINER_CACHE"/layer-*.tar
bash tests/container/base-images.sh

started=$SECONDS
exec 9>"$TSM_CONTAINER_BUILD_LOCK"
flock 9
image=localhost/tensorshm:test
build_image=localhost/tensorshm-build:test
# shellcheck disable=SC2206 # $BUILDAH is a command line, split into words on purpose
bud=($BUILDAH bud --isolation chroot --network host --pull=never --format docker --layers
  --build-arg DEBIAN_IMAGE=localhost/debian:bookworm
  --build-arg DEBIAN_SLIM_IMAGE=localhost/debian:bookworm-slim)
echo "test-container: ${bud[*]} -t $image ."
"${bud[@]}" -t "$image" .
# The build stage as an image too (every step cached by now): the test builds its client there.
echo "test-container: ${bud[*]} --target build -t $build_image ."
"${bud[@]}" --quiet --target build -t "$build_image" . >/dev/null
# Images the tags above replaced (an earlier run's), and their layers no other image uses.
$BUILDAH rmi --prune >/dev/null
exec 9>&-
echo "test-container: built in $((SECONDS - started)) s"

# A private mount namespace: the tmpfs and bind mounts the test makes are seen by the
# containers it starts and by nothing outside, and go when it exits, whatever happens.
exec unshare --mount --propagation private \
  /usr/bin/python3 tests/container/container_test.py --image "$image" \
  --build-image "$build_image" "$@"
