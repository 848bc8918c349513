# cpuservice developer targets. `bash scripts/test.sh` sets everything up and runs `make test`.
PY      := .venv/bin/python
DEBPY   := /usr/bin/python3
PYTEST  := -m pytest -q -p no:cacheprovider

.PHONY: setup lint test test-unit test-unit-venv test-unit-debian test-integration test-lab \
        test-lab-modern bench-placement bench-service bench-hotplug bench-irq bench-partition \
        run man deb

setup:
	bash scripts/install-deps.sh all
	bash scripts/setup-venv.sh

lint:
	$(PY) -m ruff check cpuservice bench tests
	$(PY) -m mypy

# Each tier says when it starts and how long it took (scripts/tier.sh); the first failure stops.
TIER    := bash scripts/tier.sh
SUBMAKE := $(MAKE) --no-print-directory
test:
	@$(TIER) lint $(SUBMAKE) lint
	@$(TIER) unit-pypi $(SUBMAKE) test-unit-venv
	@$(TIER) unit-debian $(SUBMAKE) test-unit-debian
	@$(TIER) integration $(SUBMAKE) test-integration
	@$(TIER) lab $(SUBMAKE) test-lab

test-unit: test-unit-venv test-unit-debian

# pydantic 2.x / dbus-fast 5.x from PyPI
test-unit-venv:
	$(PY) $(PYTEST) tests/unit

# Debian 12's own pydantic 1.10.4 / dbus-fast 1.84.2 / pytest / hypothesis
test-unit-debian:
	$(DEBPY) -c 'import pydantic, sys; sys.exit(not pydantic.VERSION.startswith("1."))'
	PYTHONPATH=$(CURDIR) $(DEBPY) $(PYTEST) tests/unit

test-integration:
	$(PY) $(PYTEST) tests/integration

# both VM labs: Debian 12 (systemd 252) and Debian sid (systemd >= 261, kernel partitions)
test-lab:
	$(PY) $(PYTEST) tests/lab

# the sid lab alone
test-lab-modern:
	$(PY) $(PYTEST) tests/lab/test_lab_partitions.py -k "not debian12"

bench-placement:
	$(PY) bench/placement.py

run:
	bash scripts/run.sh

# man pages from their scdoc sources in docs/man
man:
	mkdir -p build/man
	for f in docs/man/*.scd; do scdoc < $$f > build/man/$$(basename $$f .scd) || exit 1; done

bench-service:
	PYTHONPATH=$(CURDIR) $(PY) bench/service.py

bench-hotplug:
	PYTHONPATH=$(CURDIR) $(PY) bench/hotplug.py

bench-partition:
	PYTHONPATH=$(CURDIR) $(PY) bench/partition.py

bench-irq:
	PYTHONPATH=$(CURDIR) $(PY) bench/irq.py

deb:
	bash scripts/build-deb.sh
