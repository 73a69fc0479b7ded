# marind: `make setup` installs everything (idempotent); `make demo`; `make unit` (seconds); `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: setup demo lint unit test test-all chaos bench clean

setup: $(VENV)/.setup-stamp

$(VENV)/.setup-stamp: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: the project's range (torch>=2.6) then pulls nothing more
	$(PIP) install -q --disable-pip-version-check "torch==$(TORCH_VERSION)"
	$(PIP) install -q --disable-pip-version-check -e '.[test,torchft,torchx,curves]'
	@{ command -v etcd && command -v etcdctl; } >/dev/null 2>&1 || { \
	  echo "installing etcd-server and etcd-client (Debian packages)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client; }
	@# nft: the multi-host bed's half-working links (marind.testing.hosts_filter); the bed needs root, so only
	@# as root (elsewhere the bed tests skip, saying why)
	@[ "$$(id -u)" != 0 ] || command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || { \
	  echo "installing nftables (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables; }
	@# shellcheck: tests/integrations/test_slurm_script.py checks examples/slurm/marind.sbatch with it
	@command -v shellcheck >/dev/null 2>&1 || { \
	  echo "installing shellcheck (Debian package)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck; }
	@# Slurm and munge: the bed's Slurm tests (marind.testing.slurm_bed, tests/chaos/test_host_slurm.py) run a
	@# slurmctld and a slurmd per bed host; the bed needs root, so only as root (elsewhere they skip, saying why).
	@# Only the binaries: no service is started (the tests start their own daemons on their own config).
	@[ "$$(id -u)" != 0 ] || { [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
	  && command -v sbatch >/dev/null 2>&1; } || { \
	  echo "installing slurmctld slurmd slurm-client munge (Debian packages)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge; }
	@# chromium: the job page's browser test (tests/agent/test_job_page.py, headless); only as root, like the
	@# bed's packages (elsewhere the test skips, saying why)
	@[ "$$(id -u)" != 0 ] || command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	@etcd --version | head -1
	@$(VENV)/bin/weed version
	@touch $@

demo: setup
	$(PY) -m marind.demo

# ruff (lint) and mypy (types) over the shipped packages; the layering rules of tools/import_graph.py.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) tools/import_graph.py --check

# The unit tests alone: no process, no server (pure functions, files in tmp_path); seconds.
unit: setup
	$(PY) -m pytest -m unit -q -p no:cacheprovider $(PYTEST_ARGS)

# The CI suite: lint, then everything except the long chaos scenarios' full forms (`make chaos`).
test: setup lint
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-all: setup
	MARIND_FULL=1 $(MAKE) test

# Every chaos scenario in full; each adds its row to build/faults.jsonl, rendered at the end
# (docs/perf.md's faults table: restarts, recovery, steps lost, checkpoints lost, violations).
chaos: setup
	@mkdir -p build && rm -f build/faults.jsonl
	@MARIND_FULL=1 MARIND_FAULTS_TABLE=$(CURDIR)/build/faults.jsonl $(PY) -m pytest tests/chaos $(PYTEST_ARGS); rc=$$?; \
	if [ -s build/faults.jsonl ]; then $(PY) tools/faults_table.py build/faults.jsonl || rc=1; fi; exit $$rc

bench: setup
	$(PY) bench/ckpt_bench.py
	$(PY) bench/train_bench.py
	$(PY) bench/daemon_bench.py
	$(PY) bench/goodput.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
