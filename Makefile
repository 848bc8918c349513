# cpuservice developer targets. `bash scripts/test.sh` sets everything up and runs `make test`.
PY      := .venv/bin/python
DEBPY   := /usr/bin/python3
PYTEST  := -m pytest -q -p no:cacheprovider
# the unit tiers' scratch files on a tmpfs of their own (scripts/scratch-tmpfs.sh says why)
SCRATCH := bash scripts/scratch-tmpfs.sh

.PHONY: setup lint test test-explore test-unit test-unit-venv test-unit-debian test-integration test-lab \
        test-lab-modern test-lab-containers test-lab-debian13 bench-placement bench-service \
        bench-hotplug bench-irq bench-partition bench-lending bench-lending-read bench-bus \
        bench-figures test-debian12 test-debian13 \
        run man deb

setup:
	bash scripts/install-deps.sh all
	bash scripts/setup-venv.sh

lint:
	$(PY) -m ruff check cpuservice bench tests
	$(PY) -m mypy

# Each tier says when it starts and how long it took (scripts/tier.sh); every tier runs even
# after another failed, and a table of them (with what failed) closes the run. The VM lab runs
# beside the others (&: scripts/tiers.sh).
test:
	@bash scripts/tiers.sh '&lab:test-lab' lint:lint unit-pypi:test-unit-venv \
	    unit-debian:test-unit-debian integration:test-integration

# Random exploration of the property tests (the gate's are derandomized: tests/props.py): a
# fresh seed each run (or SEED=N to repeat one), EXPLORE_SCALE times the gate's examples.
EXPLORE_SCALE ?= 20
test-explore:
	@seed=$${SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "==> explore: hypothesis seed $$seed, $(EXPLORE_SCALE)x the gate's examples"; \
	CPUSERVICE_HYPOTHESIS=explore CPUSERVICE_EXPLORE_SCALE=$(EXPLORE_SCALE) \
	    $(SCRATCH) $(PY) $(PYTEST) tests/unit --hypothesis-seed=$$seed; rc=$$?; \
	echo "==> explore: seed $$seed, exit $$rc (repeat: make test-explore SEED=$$seed)"; \
	exit $$rc

test-unit: test-unit-venv test-unit-debian

# pydantic 2.x / dbus-fast 5.x from PyPI
test-unit-venv:
	$(SCRATCH) $(PY) $(PYTEST) tests/unit

# the distribution's own Python, pydantic, dbus-fast, pytest and hypothesis, whatever they are
# (Debian 12: 3.11, 1.10.4, 1.84.2; Debian 13: 3.13, 2.10.6, 2.44.1); it says which
test-unit-debian:
	@$(DEBPY) -c 'import sys, pydantic, hypothesis; from importlib.metadata import version as v; \
	    print("==> Debian", open("/etc/debian_version").read().strip(), "Python", \
	          sys.version.split()[0], "pydantic", pydantic.VERSION, "dbus-fast", v("dbus-fast"), \
	          "hypothesis", hypothesis.__version__)'
	PYTHONPATH=$(CURDIR) $(SCRATCH) $(DEBPY) $(PYTEST) tests/unit

test-integration:
	$(PY) $(PYTEST) tests/integration

# both VM labs: Debian 12 (systemd 252) and Debian sid (systemd >= 261, kernel partitions)
test-lab:
	$(PY) $(PYTEST) tests/lab

# the containers lab alone (Debian 12 with podman: lab.PODMAN)
test-lab-containers:
	$(PY) $(PYTEST) tests/lab/test_lab_containers.py

# the Debian 13 lab alone (lab.TRIXIE: the package built on Debian 13, the service on it)
test-lab-debian13:
	$(PY) $(PYTEST) tests/lab/test_lab_debian13.py

# the sid lab alone
test-lab-modern:
	$(PY) $(PYTEST) tests/lab/test_lab_partitions.py -k "not debian12"

bench-placement:
	PYTHONPATH=$(CURDIR) $(PY) bench/placement.py

run:
	bash scripts/run.sh

# man pages from their scdoc sources in docs/man
man:
	sh scripts/man.sh build/man

bench-service:
	PYTHONPATH=$(CURDIR) $(PY) bench/service.py

bench-hotplug:
	PYTHONPATH=$(CURDIR) $(PY) bench/hotplug.py

bench-partition:
	PYTHONPATH=$(CURDIR) $(PY) bench/partition.py

bench-irq:
	PYTHONPATH=$(CURDIR) $(PY) bench/irq.py

# VM lab: an owner's cyclictest latency unlent/lent, the borrower's harvest, withdrawal time
bench-lending:
	PYTHONPATH=$(CURDIR) $(PY) bench/lending.py

# no VM: what reading a busy owner's threads costs the lending loop, on this machine's /proc
bench-lending-read:
	PYTHONPATH=$(CURDIR) $(PY) bench/lending_read.py

# any local user's bulk reads against the daemon on a private bus (no container; as root)
bench-bus:
	PYTHONPATH=$(CURDIR) $(PY) bench/bus.py

# option near: looking up devices (64 on a fixture tree), placing and counting next to one
.PHONY: bench-near
bench-near:
	PYTHONPATH=$(CURDIR) $(PY) bench/near.py

# reading how 3,000 allocations fare from a fake cgroup tree on tmpfs (issue 39)
bench-figures:
	PYTHONPATH=$(CURDIR) $(PY) bench/figures.py

deb:
	bash scripts/build-deb.sh

# Another Debian release from this machine, in a chroot: lint, both unit tiers, the package
# with lintian (scripts/test-release.sh); one summary line
test-debian13:
	bash scripts/test-release.sh 13

test-debian12:
	bash scripts/test-release.sh 12
