# tensorshmd container image: Debian bookworm, built with Debian's -dev packages, run as a
# non-root user with only the shared libraries the binaries link.
#
#   docker build -t tensorshm .
#   docker run -d --name tensorshmd -v tensorshm-sock:/run/tensorshm tensorshm
#   docker run --rm -v tensorshm-sock:/run/tensorshm --user 10001 --entrypoint tensorshmctl \
#     tensorshm status
#
# `make test-container` (tests/container/test-container.sh) builds this file with buildah
# (`buildah bud`) from base images made locally with debootstrap, then runs the image's daemon,
# HEALTHCHECK and a client, and the Kubernetes manifests' containers. DEBIAN_IMAGE and
# DEBIAN_SLIM_IMAGE name the base images (Docker Hub's by default; the test passes its own):
#
#   buildah bud --format docker --build-arg DEBIAN_IMAGE=localhost/debian:bookworm \
#     --build-arg DEBIAN_SLIM_IMAGE=localhost/debian:bookworm-slim -t tensorshm .
ARG DEBIAN_IMAGE=debian:bookworm
ARG DEBIAN_SLIM_IMAGE=debian:bookworm-slim

# ---- Build stage ----
FROM ${DEBIAN_IMAGE} AS build
ARG DEBIAN_FRONTEND=noninteractive
# The -dev packages of scripts/setup.sh, less the test-only ones (GoogleTest, clang, spin).
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake pkg-config python3 \
      python3-venv ca-certificates libgrpc++-dev libprotobuf-dev protobuf-compiler \
      protobuf-compiler-grpc libboost-dev libabsl-dev libcli11-dev libspdlog-dev libtoml11-dev \
      libcpp-httplib-dev nlohmann-json3-dev \
 && rm -rf /var/lib/apt/lists/*
# Headers Debian main does not have, from PyPI into a build-only venv:
# - dlpack/dlpack.h (DLPack >= 1.3) from apache-tvm-ffi (tvm-ffi-config --dlpack-includedir);
# - CUDA's driver API header cuda.h from NVIDIA's nvidia-cuda-runtime-cu12 wheel (3.5 MB). The
#   driver itself is dlopen'd at run time, so nothing from the wheel reaches the image. (Debian
#   has cuda.h only in non-free's nvidia-cuda-dev: a 774 MB download, 2.8 GB installed.)
RUN python3 -m venv /opt/build-venv \
 && /opt/build-venv/bin/pip install --no-cache-dir --disable-pip-version-check \
      "apache-tvm-ffi>=0.1.0" "nvidia-cuda-runtime-cu12>=12.4,<13" \
 && /opt/build-venv/bin/python -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cuda_runtime', 'include'))" \
      > /opt/build-venv/cuda-include-dir \
 && test -f "$(cat /opt/build-venv/cuda-include-dir)/cuda.h"
WORKDIR /src
# The build context, less what .dockerignore leaves out (build trees, .venv, .git).
COPY . /src
RUN cmake -S /src -B /build -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr/local \
      -DTENSORSHM_BUILD_TESTS=OFF -DTENSORSHM_BUILD_BENCH=OFF \
      -DDLPACK_INCLUDE_DIR="$(/opt/build-venv/bin/tvm-ffi-config --dlpack-includedir)" \
      -DCUDA_DRIVER_INCLUDE_DIR="$(cat /opt/build-venv/cuda-include-dir)" \
 && cmake --build /build -j"$(nproc)" \
 && DESTDIR=/staging cmake --install /build --strip \
 && test -x /staging/usr/local/bin/tensorshmd \
 && rm -rf /staging/usr/local/include /staging/usr/local/lib/cmake \
 && sh /src/scripts/container-runtime-packages.sh /staging/usr/local/bin /staging/usr/local/lib \
      > /staging/runtime-packages.txt \
 && cat /staging/runtime-packages.txt

# ---- Runtime stage ----
FROM ${DEBIAN_SLIM_IMAGE} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
# Exactly the Debian packages holding the shared libraries the installed binaries link (found
# with ldd in the build stage), so the list follows the code without being edited here.
COPY --from=build /staging/runtime-packages.txt /usr/local/share/tensorshm/runtime-packages.txt
RUN apt-get update \
 && apt-get install -y --no-install-recommends $(cat /usr/local/share/tensorshm/runtime-packages.txt) \
 && rm -rf /var/lib/apt/lists/*
# tensorshmd, tensorshmctl (once built) and libtensorshm; no headers, no CMake package files.
COPY --from=build /staging/usr/local/bin/ /usr/local/bin/
COPY --from=build /staging/usr/local/lib/ /usr/local/lib/
# A fixed uid/gid, so that host directories, Kubernetes securityContexts and --allow-uid lists
# can name it. The socket's directory belongs to that user, mode 0711: the daemon accepts it (its
# own, not writable by others), and clients of other uids admitted with --allow-uid can reach
# the socket (0666 then) without listing the directory. A named volume mounted there starts as
# a copy of it, owner and mode included.
RUN ldconfig \
 && groupadd --system --gid 10001 tensorshm \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tensorshm \
 && install -d -o 10001 -g 10001 -m 0711 /run/tensorshm
VOLUME ["/run/tensorshm"]
ENV TENSORSHM_SOCKET=/run/tensorshm/tensorshm.sock
USER 10001:10001
LABEL org.opencontainers.image.title="tensorshm" \
      org.opencontainers.image.description="tensorshmd: node-local tensor sharing over shared memory"
# SIGTERM drains, removes the socket (and the segments unless --keep-segments) and exits 0.
STOPSIGNAL SIGTERM
# tensorshmctl reads TENSORSHM_SOCKET; exit 0 only while the daemon is SERVING.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/tensorshmctl", "--timeout", "2s", "health"]
ENTRYPOINT ["/usr/local/bin/tensorshmd"]
# memfd segments by default: a `docker run` without --shm-size (64 MiB of /dev/shm) still gets
# the 1 GiB default pool. For segments that survive a daemon crash, run with e.g.
#   --shm-size=1100m tensorshm --segments shm --keep-segments --shm-prefix tsm-main
CMD ["--segments", "memfd"]
