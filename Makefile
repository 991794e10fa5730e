# One environment per supported LMDeploy release, CPU-only (see requirements/cpu-serving.txt).
LMDEPLOY_VERSIONS ?= 0.17.0 0.18.0
DEMO_LMDEPLOY ?= 0.18.0
PYTHON ?= python3
VENVS := .venv
PYTEST_ARGS ?=

.PHONY: env test unit demo bench lint clean system-deps

system-deps:  ## Debian's libibverbs1: Mooncake's transfer engine links it even for TCP
	@if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; fi

$(VENVS)/lmdeploy-%/.requirements: requirements/cpu-serving.txt requirements/dev.txt
	$(PYTHON) -m venv $(VENVS)/lmdeploy-$*
	$(VENVS)/lmdeploy-$*/bin/pip install -q --upgrade pip
	$(VENVS)/lmdeploy-$*/bin/pip install -q -r requirements/cpu-serving.txt -r requirements/dev.txt
	$(VENVS)/lmdeploy-$*/bin/pip install -q --no-deps lmdeploy==$*
	touch $@

env: system-deps $(foreach v,$(LMDEPLOY_VERSIONS),$(VENVS)/lmdeploy-$(v)/.requirements)  ## all venvs, with this package installed as a wheel
	@for v in $(LMDEPLOY_VERSIONS); do \
		$(VENVS)/lmdeploy-$$v/bin/pip install -q --no-deps --force-reinstall . || exit 1; done
	@rm -rf build *.egg-info  # setuptools builds in the tree; stale metadata here would shadow the wheel's

test: env  ## the whole suite against every supported LMDeploy release, then proof that regressions fail on stock
	@for v in $(LMDEPLOY_VERSIONS); do \
		echo "=== LMDeploy $$v"; \
		env -u LMDEPLOY_PDFIX $(VENVS)/lmdeploy-$$v/bin/python -m pytest $(PYTEST_ARGS) || exit 1; \
		echo "=== LMDeploy $$v, patches off: every regression test must fail"; \
		env -u LMDEPLOY_PDFIX $(VENVS)/lmdeploy-$$v/bin/python scripts/prove_regressions.py || exit 1; done

unit: env  ## everything but the cluster end-to-end suite
	@$(MAKE) --no-print-directory test PYTEST_ARGS="-m 'not e2e' $(PYTEST_ARGS)"

demo: LMDEPLOY_VERSIONS = $(DEMO_LMDEPLOY)
demo: env  ## 1 Prefill + 1 Decode, stock then patched, side by side
	$(VENVS)/lmdeploy-$(DEMO_LMDEPLOY)/bin/python scripts/demo.py

bench: env  ## start-up cost of the hook, and stock vs patched cluster throughput
	$(VENVS)/lmdeploy-$(DEMO_LMDEPLOY)/bin/python scripts/bench_startup.py
	$(VENVS)/lmdeploy-$(DEMO_LMDEPLOY)/bin/python benchmarks/bench_cluster.py

lint: env
	$(VENVS)/lmdeploy-$(DEMO_LMDEPLOY)/bin/ruff check .

clean:
	rm -rf $(VENVS) build dist *.egg-info
