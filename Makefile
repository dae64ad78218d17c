# Two entry points: `make serve` and `make test`. Both build the virtual
# environment at $(VENV) once; a stamp file remembers what was installed, so
# the second run only starts the server or the tests.

PYTHON     ?= python3
VENV       ?= .venv
# The torch requirement. The default resolves to the CPU wheel where pip's
# find-links offer one; on a CUDA machine pass a CUDA build, for example
#   make serve TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

VPY   := $(VENV)/bin/python
# The stamp is named after TORCH_SPEC, so asking for another torch reinstalls.
STAMP := $(VENV)/.installed-$(shell printf '%s' '$(TORCH_SPEC)' | cksum | cut -d' ' -f1)

.PHONY: venv serve artifacts test clean

venv: $(STAMP)

# The client (its own distribution, client/) is installed after the package:
# reinstalling an auk-triton that still carried the auk-client script removes it.
$(STAMP): requirements.txt requirements-gpu.txt pyproject.toml client/pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(TORCH_SPEC)
	$(VPY) -m pip install -r requirements.txt
	$(VPY) -m pip install --no-deps -r requirements-gpu.txt
	$(VPY) -m pip install -e ".[test]"
	$(VPY) -m pip install -e ./client
	rm -f $(VENV)/.installed-*
	touch $@

# Triton in the foreground on model_repository/ (ports from AUK_HTTP_PORT,
# AUK_GRPC_PORT, AUK_METRICS_PORT; checkpoint from AUK_CHECKPOINT).
# Compile caches, synthetic checkpoints and the backend folder go to .cache/ here
# (`make clean` removes it) unless AUK_CACHE_DIR says otherwise.
serve: $(STAMP)
	AUK_CACHE_DIR="$${AUK_CACHE_DIR:-$(CURDIR)/.cache}" $(VPY) -m auk_triton.front_door.launcher

# The start-up artifacts for this machine's GPU, torch and code (docs/operating.md): starts
# the server once as `make serve` would, without the front door, until READY. The decode's
# compiled buckets go to AUK_ARTIFACTS_DIR, else .cache/artifacts, where `make serve` looks.
artifacts: $(STAMP)
	AUK_CACHE_DIR="$${AUK_CACHE_DIR:-$(CURDIR)/.cache}" $(VPY) -m auk_triton.front_door.prepare

test: $(STAMP)
	$(VPY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache
