# The two commands of the README: `make demo` and `make test`.
# Both create .venv on first use and reinstall when the project's files change.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup cli-docs lint test-tools

setup: $(STAMP)

# trio-typing (a dependency of libp2p) also installs `trio-stubs` and `outcome-stubs`, written for
# trio 0.22: mypy prefers them to the inline types of the trio we run (no TaskStatus, no
# abandon_on_cancel), so they go. The runtime module trio_typing, which libp2p imports, stays.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	rm -rf $(VENV)/lib/python*/site-packages/trio-stubs $(VENV)/lib/python*/site-packages/outcome-stubs
	touch $@

demo: $(STAMP)
	$(BIN)/p2ptrain demo --peers 4

# docs/cli.md, generated from the argument parser (tests/test_cli_reference.py fails while it is stale).
cli-docs: $(STAMP)
	$(BIN)/python -m p2ptrain.cli.reference --write

# js-ipfs, the RPC daemon the Kubo-backend tests run against (tests/ipfs/test_kubo.py); installed once
# (~4 min). Without node/npm the tests skip and say why.
JSIPFS_STAMP := ipfs/.jsipfs/.installed

$(JSIPFS_STAMP): ipfs/install-jsipfs.sh
	@if command -v node >/dev/null && command -v npm >/dev/null; then \
		rm -f $@ && ipfs/install-jsipfs.sh; \
	else echo "node/npm not found: the Kubo-backend tests will be skipped" >&2; fi

# Helia (JS IPFS on js-libp2p 3) and a Node 22 binary from npm, for the Bitswap interop test
# (tests/ipfs/test_helia.py); installed once (~1 min). Without npm the test skips and says why.
HELIA_STAMP := ipfs/.helia/.installed

$(HELIA_STAMP): ipfs/install-helia.sh
	@if command -v npm >/dev/null; then \
		rm -f $@ && ipfs/install-helia.sh; \
	else echo "npm not found: the Helia interop test will be skipped" >&2; fi

# Tools the suite needs from the system, as TOOL:DEBIAN-PACKAGE pairs (tests/conftest.py reads this
# line): the emulated WAN's `ip` and `tc`, the emulated NAT's `iptables`. Installed when missing and
# this runs as root; otherwise their tests skip and say why. Under CI=true a test that finds one of
# these missing fails instead of skipping (tests/conftest.py): CI never passes by running less.
TEST_TOOLS := ip:iproute2 tc:iproute2 iptables:iptables

test-tools:
	@missing=""; for pair in $(TEST_TOOLS); do \
		command -v "$${pair%%:*}" >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; \
	done; \
	missing=$$(echo $$missing | tr ' ' '\n' | sort -u | tr '\n' ' '); \
	if [ -z "$${missing% }" ]; then exit 0; fi; \
	if [ "$$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "not root (or no apt-get): not installing $$missing; the tests that need it will skip" >&2; \
	else \
		echo "installing $$missing for the WAN/NAT tests" >&2; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# pytest exits 5 when it collected no tests: that is a failure here, never a pass.
# pytest-xdist workers. On the 2-core machine, idle, 2026-11-26: 1150 s with two workers and
# 1041 s with four (every test passing in both; 29 min of user CPU in 17 min: the suite is CPU-bound,
# mostly the imports of the node processes it starts), so more workers buy little and cost flakes.
# With the fork server and the quick timers (docs/testing.md), same machine, quiet, 2026-11-26 17:40:
# 578 s with two workers, 1,434 passed. With two workers the cores were half idle (user+sys 10.2 min
# in 9.6 min); four, 2026-11-26 22:00 and 23:46: 496 s and 498 s (1,481 and 1,515 tests), 12.6-13 min
# of CPU: the suite is CPU-bound again, so more workers would buy nothing. Four it is (00:00, after
# the merges: 446 s, 1,515 passed, 11.7 min of CPU). 2026-11-27, quiet, 1,667 tests: four workers
# 448-501 s (1.2 cores busy: the suite waits more than it computes now), six 454 s (1.45): no clear gain.
# 2026-11-27 14:00-14:35, quiet, the same tree (1,756-1,757 tests, after the runs whose members all
# join at once stopped waiting out term 0): four workers 509 s (user+sys 9.9 min, 1.15 cores busy);
# six 468 s (one failure, a real Bitswap race at a peer's stop, fixed) and 430 s (all passed, 9.8 min):
# the tests wait more than they compute now, so two more workers fill the idle cores. Six it is.
# 2026-11-27 evening: eight (one helper's tests beside them) took 623 s against 405 s with six: the
# machine was already busy 82-90% of a six-worker run (vmstat), and under the extra load the pipelined
# runs' replicas missed their deadlines and were convicted and waited out (docs/testing.md).
TEST_WORKERS ?= 6

# ruff (tests, benches too) and mypy (strict on p2ptrain/; pyproject.toml lists any module that is
# not) before the suite: a few seconds with mypy's cache (.mypy_cache), ~1 min without.
lint: $(STAMP)
	$(BIN)/ruff check --quiet .
	$(BIN)/mypy

# `env -u PYTHONDONTWRITEBYTECODE`: this machine's environment sets it, so every worker recompiled the
# package and pytest rewrote the asserts of every test module on each run (~4.7 CPU-s a worker, of its
# ~13 CPU-s of collection; 8.5 with the cached .pyc files, which .gitignore keeps out of git).
test: lint test-tools $(JSIPFS_STAMP) $(HELIA_STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; \
	exit $$rc
