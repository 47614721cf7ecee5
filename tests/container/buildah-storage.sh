# shellcheck shell=bash
# Sourced (not run) by the container tests: where they keep their cache and buildah's images, so
# that base-images.sh, test-container.sh and test-packages.sh see the same store.
#
#   source tests/container/buildah-storage.sh
#   $BUILDAH images
#
# A store of its own under the cache directory (vfs: plain directories, no overlay mounts), so it
# neither reads nor disturbs any other buildah or podman store on the machine.
# TSM_CONTAINER_CACHE moves it all; its path must not contain spaces.
#
# A test that builds in this store holds TSM_CONTAINER_BUILD_LOCK (flock) while it builds and
# prunes: `buildah rmi --prune` removes any untagged image without children, which is what the
# newest layer of a build in progress is.
TSM_CONTAINER_CACHE=${TSM_CONTAINER_CACHE:-/var/cache/tensorshm-test-container}
BUILDAH="buildah --root $TSM_CONTAINER_CACHE/storage --runroot $TSM_CONTAINER_CACHE/run --storage-driver vfs"
TSM_CONTAINER_BUILD_LOCK=$TSM_CONTAINER_CACHE/build.lock
export TSM_CONTAINER_CACHE BUILDAH TSM_CONTAINER_BUILD_LOCK
