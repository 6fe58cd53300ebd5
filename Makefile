# The two commands of the README:
#   make run    trains the Wine example with DDP on 2 CPU ranks under ddprun
#   make test   runs every test
# Both install what is missing (scripts/setup.sh) and build incrementally first.

BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CTEST_ARGS ?=

# The virtualenv holding the pinned torch; scripts/setup.sh creates it once
# per machine in ~/.cache/ddp (or $DDP_CACHE_DIR, or uses $DDP_VENV).
VENV_FILE := $(BUILD_DIR)/.venv-path

.PHONY: sanitize all configure build setup run test bench bench-net clean install plot

all: build

setup:
	@mkdir -p $(BUILD_DIR)
	@bash scripts/setup.sh > $(VENV_FILE).new && mv $(VENV_FILE).new $(VENV_FILE)

configure: setup
	@venv=$$(cat $(VENV_FILE)); \
	if ! bash scripts/is_configured.sh $(BUILD_DIR) $$venv/bin/python; then \
	  cmake -S . -B $(BUILD_DIR) -G Ninja -DDDP_PYTHON=$$venv/bin/python $(CMAKE_ARGS) || exit 1; \
	fi

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

# A fresh run each time: wine_ddp would otherwise resume from the last one's
# snapshots and have nothing left to train. Only what the job runs is built
# (the library, ddprun and wine_ddp), not the tests and benchmarks.
run: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS) --target ddprun wine_ddp
	@rm -rf runs/wine && mkdir -p runs/wine
	$(BUILD_DIR)/bin/ddprun --standalone --nproc-per-node 2 \
	  $(BUILD_DIR)/bin/wine_ddp 100 50 --checkpoint-dir runs/wine

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j 2 --timeout 300 $(CTEST_ARGS)

# The torch-free parsers of untrusted bytes (the liveness connection's reader) under
# AddressSanitizer and UndefinedBehaviorSanitizer, with hostile and random input.
sanitize:
	@mkdir -p $(BUILD_DIR)/sanitize
	g++ -std=c++17 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all -Isrc \
	  tests/test_liveness_inbound.cpp src/fault/socket_watch.cpp -lgtest -lgtest_main -pthread \
	  -o $(BUILD_DIR)/sanitize/liveness_inbound
	$(BUILD_DIR)/sanitize/liveness_inbound

# Loss and accuracy curves of --metrics files: make plot METRICS="a.jsonl b.jsonl" OUT=curves.png
OUT ?= curves.png
plot: setup
	$$(cat $(VENV_FILE))/bin/python tools/plot/ddp_plot.py $(METRICS) -o $(OUT)

# Headers, libddp, ddprun and the CMake package (find_package(ddp)).
PREFIX ?= /usr/local
install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD_DIR)

# Side-by-side benchmark against PyTorch's Python DDP; writes bench/RESULTS.md.
bench: build
	$$(cat $(VENV_FILE))/bin/python bench/run_bench.py --build-dir $(BUILD_DIR)

# ddp against Python DDP on an emulated cluster (network namespaces,
# tbf-limited links at 1 and 10 Gbit/s): 2 nodes (bench/NETWORK.md), then 4
# nodes with the 2M MLP (bench/NETWORK_4NODES.md). Needs root.
bench-net: build
	$$(cat $(VENV_FILE))/bin/python bench/run_net_bench.py --build-dir $(BUILD_DIR)
	$$(cat $(VENV_FILE))/bin/python bench/run_net_bench.py --build-dir $(BUILD_DIR) --nodes 4 --models mlp2m
	$$(cat $(VENV_FILE))/bin/python bench/slow_links.py --build-dir $(BUILD_DIR)
