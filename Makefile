# tensorshm: `make run` serves on the defaults, `make test` builds and runs every test.
# Both install what they need first (Debian packages as root, Python packages into .venv).

BUILD_DIR ?= build
JOBS ?= 2
PREFIX ?= /usr/local
CMAKE_FLAGS ?=
# Arguments for `make run`, e.g. make run ARGS="--host-pool 4Gi"
ARGS ?=

.PHONY: all setup configure build run test bench install format clean

all: build

setup:
	@bash scripts/setup.sh

configure: setup
	@cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD_DIR) -j$(JOBS)

run: build
	exec $(BUILD_DIR)/tensorshmd $(ARGS)

# --no-tests=error: a run that found no test fails.
test: build
	cd $(BUILD_DIR) && ctest -j$(JOBS) --output-on-failure --no-tests=error

bench: build
	$(BUILD_DIR)/bench/handoff_bench $(ARGS)

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

format:
	clang-format -i $$(git ls-files '*.cc' '*.h' '*.c')

clean:
	rm -rf $(BUILD_DIR)
