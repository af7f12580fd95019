# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv at the repo root when missing and install what is needed; pip's cache
# (~/.cache/pip) keeps torch from being downloaded again on the same machine.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed builds a small C++ op on first start; keep it across runs.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions
export PYTHONUNBUFFERED := 1

.PHONY: env proto demo demo-packing test test-fast docs bench soak kafka kafka-stop toxiproxy regions clean

env: $(STAMP)

$(STAMP): pyproject.toml setup.py feeder/_native.c feeder/_shuffle.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --progress-bar off -q --upgrade pip setuptools wheel "grpcio-tools>=1.60"
	$(PY) -m pip install --progress-bar off -q --no-build-isolation -e '.[train,bench,kafka,ops,tls,frameworks,dev,formats,docs,torchft]'
	$(PY) -m pip install --progress-bar off -q --no-deps 'mosaicml-streaming==0.13.0'
	@touch $(STAMP)

proto: env
	$(PY) -m feeder._protogen

demo: env
	$(PY) -m feeder_trainer.demo

# The same training on best-fit bins of whole documents with Megatron's three flags from the
# served boundaries (docs/packing.md): prints the padding fraction and the loss.
demo-packing: env
	$(PY) -m feeder_trainer.demo --packing

# The documentation site (docs/, mkdocs.yml) into site/. Strict: a broken link, a page missing
# from the nav or a bad setting is an error, not a warning.
export NO_MKDOCS_2_WARNING := 1
docs: env
	$(PY) -m mkdocs build --strict

# The docs are built first (strict, seconds), so a broken link fails before the long suite
# (never with --quiet: it hides the warnings that strict mode counts).
# The Kafka tests need the real broker: started before the suite, stopped after it
# whatever the outcome (the suite's exit code is kept).
# TEST_JOBS pytest workers (pytest-xdist), each taking whole files: a test spends much of its
# time waiting on servers, trainers and timeouts, so 2 workers on CI's 2 cores take the suite
# from ~18 to ~12 minutes. TEST_JOBS=0 runs it in one process.
TEST_JOBS ?= 2
PYTEST_JOBS = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)
test: env toxiproxy
	$(PY) -m mkdocs build --strict --site-dir build/site
	$(PY) deploy/kafka/broker.py start
	$(PY) -m pytest -q -ra --durations=15 $(PYTEST_JOBS); rc=$$?; $(PY) deploy/kafka/broker.py stop; exit $$rc

# Figures in bench/results.json and bench/throughput.png (the README quotes them).
bench: env
	$(PY) -m feeder.cli bench --json bench/results.json --plot bench/throughput.png

# The fault-combination harness on SEEDS random scenarios (from START, else a random start):
# progress on stderr, a summary in bench/soak.json; a failing seed replays with
# `python -m tests.chaos --seed N`.
SEEDS ?= 50
JOBS ?= 3
soak: env toxiproxy kafka
	$(PY) -m tests.chaos --seeds $(SEEDS) $(if $(START),--start $(START)) --jobs $(JOBS) --json bench/soak.json

# A single-node Apache Kafka broker (KRaft) on 127.0.0.1:9092, fetched from Maven Central.
kafka:
	$(PYTHON) deploy/kafka/broker.py start

kafka-stop:
	$(PYTHON) deploy/kafka/broker.py stop

# Toxiproxy for the WAN tests, built from the Go module proxy into ~/.cache/feeder/toxiproxy
# (kept across runs); without Go the tests use their user-space proxy instead.
toxiproxy: env
	@$(PY) -c "from feeder_bench.wanproxy import ensure_toxiproxy as e; p = e(); \
	print('toxiproxy:', p or 'no Go here, the WAN tests use the user-space proxy')"

# Three regions on this host (deploy/local/): us-east, eu-west, ap-south on 127.0.0.1:7101-7103.
regions: env
	$(PY) deploy/local/launch.py $(if $(DATASET),--dataset $(DATASET))

test-fast: env
	$(PY) -m pytest -q -ra -m "not slow and not kafka" $(PYTEST_JOBS)

clean:
	rm -rf $(VENV) build site *.egg-info feeder/v1/*_pb2*.py* feeder/tfrecord/*_pb2*.py* feeder/v1/.generated
