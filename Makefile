# egress: `make demo` and `make test` install whatever is missing, then run.
# A fresh Debian machine as root needs nothing else.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
STAMPS := .make
# Debian packages: the datapath (nftables, iproute2), in-process nft (python3-nftables, used
# from a venv made with --system-site-packages), DNS tools for tests and benchmarks, and the
# real tunnel tools the detection tests run; a C compiler and Python's headers for the
# compiled hot modules (egress/native.py: the tunnel scorer, the NFLOG copies' walk, the
# resolver core, the observer's sift);
# iptables-nft, whose NFQUEUE target (through nft_compat) queues packets on kernels built
# without nft's own queue statement; podman (CNI backend), runc, the reference CNI plugins and busybox-static for the container
# tests' runtime and image (no registry needed).
APT_PKGS := nftables python3-nftables python3-venv python3-pip iproute2 dnsutils iodine \
	dns2tcp dnsmasq-base dnsperf tcpdump procps util-linux bubblewrap tini python3-seccomp \
	git openssl gcc python3-dev iptables podman runc containernetworking-plugins busybox-static
# What mypyc compiles (each package's native.NATIVE) holds what it imports of egress too (a
# build is stale once any of them changes: egress/native.py): rebuilt when any module does.
NATIVE_SRC := $(shell find egress -name '*.py' -not -path '*/_native*')

.PHONY: help setup demo test test-unit lint bench image clean

help:
	@echo "make demo   install what is missing, then run the demo (no network needed)"
	@echo "make test   install what is missing, then run the whole test suite"
	@echo "make lint   ruff, mypy --strict egress/, import-linter layer contracts"
	@echo "make bench  run the benchmarks in bench/ and print their figures"
	@echo "make image  build the OCI image localhost/egress:VERSION (Debian packages, no registry)"

$(STAMPS)/apt: Makefile
	@mkdir -p $(STAMPS)
	@missing=$$(for p in $(APT_PKGS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
		| grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then echo "missing Debian packages: $$missing (run as root)"; exit 1; fi; \
		echo "installing: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

$(STAMPS)/venv: $(STAMPS)/apt pyproject.toml
	@test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $@

# The hot modules compiled by mypyc; without a fresh build the sources run (slower).
$(STAMPS)/native: $(STAMPS)/venv $(NATIVE_SRC)
	@$(PY) -m egress.cli.native_build
	@touch $@

# The group that may read egress's own files (journal, claims, egressd's records: 0640,
# directories 0750) and call `egressd --group egress`. Without it they are root's only.
setup: $(STAMPS)/venv $(STAMPS)/native
	@getent group egress >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then groupadd --system egress && echo "created system group egress"; \
		else echo "no group egress (groupadd --system egress as root): egress's files stay root's only"; fi; }

demo: setup
	@$(VENV)/bin/egressctl demo

# The suite runs the compiled modules; their unit tests run once more on the Python sources.
test: setup
	$(PY) -m pytest -q tests
	EGRESS_NATIVE=0 $(PY) -m pytest -q -p no:cacheprovider tests/unit \
		-k "tunnel or native or nflog or resolver or observer_flows or observer_replays or ratelimit"

test-unit: setup
	$(PY) -m pytest -q tests/unit tests/integration

lint: setup
	$(VENV)/bin/ruff check egress tests bench
	$(VENV)/bin/ruff format --check egress tests bench
	$(VENV)/bin/mypy --strict egress
	$(VENV)/bin/lint-imports

# The OCI image: a Debian root filesystem by mmdebstrap, the project's wheels in a venv,
# podman import (containers/image/build.sh). Downloads Debian packages and the wheels.
image: setup
	@command -v mmdebstrap >/dev/null || { echo "installing: mmdebstrap"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null; }
	PY=$(PY) containers/image/build.sh

# Each bench prints its figures; issue 17's targets are also recorded (bench/figures.py)
# and, once every bench has run, written into the README's table of them.
bench: setup
	@rm -f $(STAMPS)/figures.jsonl
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) bench/settle.py; \
		EGRESS_BENCH_FIGURES=$(CURDIR)/$(STAMPS)/figures.jsonl $(PY) $$b || exit 1; done
	@$(PY) bench/figures.py $(STAMPS)/figures.jsonl README.md

clean:
	rm -rf $(VENV) $(STAMPS) .pytest_cache .mypy_cache .ruff_cache *.egg-info egress/tunnel/_native* \
		egress/tunnel/.native.lock egress/datapath/_native* egress/datapath/.native.lock \
		egress/resolver/_native* egress/resolver/.native.lock egress/observer/_native* \
		egress/observer/.native.lock
