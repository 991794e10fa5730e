# One environment per supported LMDeploy release, CPU-only (see requirements/cpu-serving.txt).
LMDEPLOY_VERSIONS ?= 0.17.0 0.18.0
DEMO_LMDEPLOY ?= 0.18.0
PYTHON ?= python3
VENVS := .venv
PYTEST_ARGS ?=
# JUnit reports: a failed run ends by listing its failures from them (the last lines a CI log shows)
RESULTS := artifacts/test-results

.PHONY: env test unit e2e demo bench lint clean system-deps
.PRECIOUS: $(VENVS)/lmdeploy-%/.requirements  # a venv is built once, not deleted as an intermediate

system-deps:  ## Debian's libibverbs1: Mooncake's transfer engine links it even for TCP
	@if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; fi

$(VENVS)/lmdeploy-%/.requirements: requirements/cpu-serving.txt requirements/dev.txt
	$(PYTHON) -m venv $(VENVS)/lmdeploy-$*
	$(VENVS)/lmdeploy-$*/bin/pip install -q --upgrade pip
	$(VENVS)/lmdeploy-$*/bin/pip install -q -r requirements/cpu-serving.txt -r requirements/dev.txt
	$(VENVS)/lmdeploy-$*/bin/pip install -q --no-deps lmdeploy==$*
	touch $@

install-%: system-deps $(VENVS)/lmdeploy-%/.requirements  ## this package and the test-only emulation (sim/), as wheels
	$(VENVS)/lmdeploy-$*/bin/pip install -q --no-deps --force-reinstall . ./sim
	@rm -rf build *.egg-info sim/build sim/*.egg-info  # setuptools builds in the tree; stale metadata would shadow the wheels

env: $(foreach v,$(LMDEPLOY_VERSIONS),install-$(v))  ## every venv, with this package installed

test: unit e2e  ## the whole suite against every supported LMDeploy release, with proof that regressions fail on stock

# Each version's unit suite and stock proof keep about one core busy: the versions run side by side, each logging
# to its own file, printed once both ended (the cluster suite below keeps both cores busy: one version at a time).
unit: env  ## everything but the cluster end-to-end suite, then proof that every regression test fails on stock
	@mkdir -p $(RESULTS); pids=""; for v in $(LMDEPLOY_VERSIONS); do \
		$(MAKE) --no-print-directory unit-$$v > $(RESULTS)/unit-$$v.log 2>&1 & pids="$$pids $$!"; done; \
	failed=""; set -- $(LMDEPLOY_VERSIONS); for pid in $$pids; do wait $$pid || failed="$$failed $$1"; shift; done; \
	for v in $(LMDEPLOY_VERSIONS); do echo "=== LMDeploy $$v: unit suite, then patches off"; cat $(RESULTS)/unit-$$v.log; done; \
	for v in $$failed; do echo "=== LMDeploy $$v failed"; $(PYTHON) scripts/junit.py $(RESULTS)/unit-$$v.xml; done; \
	test -z "$$failed"

unit-%:
	@mkdir -p $(RESULTS)/tmp
	env -u LMDEPLOY_PDFIX $(VENVS)/lmdeploy-$*/bin/python -m pytest -m 'not e2e' --basetemp=$(RESULTS)/tmp/unit-$* \
		--junitxml=$(RESULTS)/unit-$*.xml $(PYTEST_ARGS)
	env -u LMDEPLOY_PDFIX $(VENVS)/lmdeploy-$*/bin/python scripts/prove_regressions.py --basetemp=$(RESULTS)/tmp/proof-$*

e2e: env  ## the cluster end-to-end suite, one version after the other
	@for v in $(LMDEPLOY_VERSIONS); do \
		echo "=== LMDeploy $$v: end-to-end"; \
		env -u LMDEPLOY_PDFIX $(VENVS)/lmdeploy-$$v/bin/python -m pytest -m e2e --junitxml=$(RESULTS)/e2e-$$v.xml \
			$(PYTEST_ARGS) || { $(PYTHON) scripts/junit.py $(RESULTS)/e2e-$$v.xml; exit 1; }; done

demo: install-$(DEMO_LMDEPLOY)  ## 1 Prefill + 1 Decode, stock then patched, side by side
	$(VENVS)/lmdeploy-$(DEMO_LMDEPLOY)/bin/python scripts/demo.py

bench: install-$(DEMO_LMDEPLOY)  ## start-up cost of the hook, and stock vs patched cluster throughput
	$(VENVS)/lmdeploy-$(DEMO_LMDEPLOY)/bin/python scripts/bench_startup.py
	$(VENVS)/lmdeploy-$(DEMO_LMDEPLOY)/bin/python benchmarks/bench_cluster.py

lint: install-$(DEMO_LMDEPLOY)
	$(VENVS)/lmdeploy-$(DEMO_LMDEPLOY)/bin/ruff check .

clean:
	rm -rf $(VENVS) build dist *.egg-info sim/build sim/*.egg-info
