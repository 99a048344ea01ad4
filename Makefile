# Two commands do everything on a fresh machine of this kind (python 3.11, x86_64, no GPU):
#   make test   - set up (venv, pinned deps, Debian prometheus) and run lint + dashboard check + tests
#   make demo   - set up and run the main job: real `vllm serve` P and D, the router, Prometheus, traces
# Re-running on a set-up machine skips the installs (stamp files).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
LOCK := requirements/cpu.lock
STAMP := $(VENV)/.stamp-$(shell cat $(LOCK) pyproject.toml 2>/dev/null | sha1sum | cut -c1-12)
SYS_STAMP := .cache/.system-deps
export HF_HUB_OFFLINE := 1
export VLLM_CACHE_ROOT ?= $(CURDIR)/.cache/vllm
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup venv system-deps test lint check-dashboards dashboards demo demo-harness bench clean

setup: venv system-deps

venv: $(STAMP)

$(STAMP): $(LOCK) pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check --no-deps -r $(LOCK)
	$(PIP) install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.stamp-*
	@touch $@

system-deps: $(SYS_STAMP)

$(SYS_STAMP):
	@mkdir -p .cache
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then \
	  echo "installing Debian prometheus (with promtool)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	fi
	@touch $@

lint: venv
	$(VENV)/bin/ruff check connector harness dashboards tests benchmarks demo

check-dashboards: venv
	$(PY) -m dashboards.generate --check

dashboards: venv
	$(PY) -m dashboards.generate

test: setup lint check-dashboards
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# DEMO_ARGS: e.g. --connector stock, --otlp-endpoint http://localhost:4317, --serve
demo: setup
	$(PY) -m demo $(DEMO_ARGS)

demo-harness: setup
	$(PY) -m harness.demo

bench: setup
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) .cache
