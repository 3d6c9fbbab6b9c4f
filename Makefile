# The README's two commands are `make demo` and `make test`; both install what is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt | md5sum | cut -c1-8)

.PHONY: install db demo serve lint test test-fast test-dj61 bench bench-churn bench-compare bench-keyed bench-paused bench-history \
	bench-cockpit-data bench-cockpit-pages chaos upgrade-drill stop check

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing Python packages into $(VENV) (pinned, requirements.txt)"
	@$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.txt
	@rm -f $(VENV)/.installed-* && touch $(STAMP)

# The project's own bytecode, written once: with PYTHONDONTWRITEBYTECODE set (common on CI and in
# images) every daemon, manage.py run and task child would compile the sources again (about 0.3 s of
# CPU each). compileall rewrites only what changed.
install: $(STAMP)
	@$(PY) -m compileall -q -j 0 manage.py accs_site tenants events workflows jobs nodes ops chaos bench tests

db: install
	@scripts/pg_local.sh start

# The demo stops the builder and agents it starts; the database and the S3 server stay up for the
# next run, and it says so.
demo: db
	@$(PY) manage.py migrate --noinput -v0
	@$(PY) manage.py demo; status=$$?; \
	  echo "left running for the next run: PostgreSQL at $$(scripts/pg_local.sh url) and the local S3 server (scripts/s3_local.sh); stop both with: make stop"; \
	  exit $$status

# The production server (gunicorn, scripts/serve.sh) on http://127.0.0.1:8000/admin/, after migrating.
# ACCS_WEB_HOST, ACCS_WEB_PORT, ACCS_WEB_WORKERS, ACCS_WEB_THREADS change where and how much it serves.
serve: db
	@$(PY) manage.py migrate --noinput -v0
	@echo "serving http://$${ACCS_WEB_HOST:-127.0.0.1}:$${ACCS_WEB_PORT:-8000}/admin/ (Ctrl-C stops; a login: $(PY) manage.py createsuperuser)"
	@exec scripts/serve.sh

# ruff (pycodestyle, pyflakes, import order, bugbear) over the repository and mypy (with django-stubs) over
# the apps; both configured in pyproject.toml. CI runs it before the tests (.ci/run).
LINT_APPS := $(wildcard accs_site tenants events workflows jobs nodes ops)
lint: install
	@$(VENV)/bin/ruff check .
	@$(PY) -m mypy $(LINT_APPS)

# The browser tests need Debian's chromium-headless-shell (or chromium) and chromedriver, the fleet test PgBouncer,
# the sandbox tests bubblewrap: installed here when missing (root or sudo).
# TEST_WORKERS parallel pytest-xdist workers, each with a PostgreSQL cluster of its own (tests/dbselect.py);
# most tests wait on real daemons rather than compute, so three per core keep the cores busy (on 2
# cores, a fresh clone: 6 workers 605-750 s, the machine's speed varying between sessions; on one day
# 6 workers took 705 s and 8 took 766 s). --dist loadgroup runs each xdist_group's tests on one
# worker, so a module's costly fixture is built once (tests/conftest.py fails a test whose group
# pytest lost).
# TEST_WORKERS=0 runs the tests in this one process.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) * 3 )))
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadgroup)
# PYTHONDONTWRITEBYTECODE is emptied for the tests: pytest keeps the test modules it rewrites (its
# assertions) as bytecode only where it may write it, and every worker rewrote them all again (about
# 4 s of CPU each).
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest
test: install
	@scripts/browser_deps.sh
	@scripts/sandbox_deps.sh
	@scripts/pgbouncer_local.sh install || echo "the fleet test through PgBouncer will be skipped"
	@$(PYTEST) $(XDIST) $(PYTEST_ARGS)

# Skip the slow chaos/race tests locally.
test-fast: install
	@scripts/browser_deps.sh
	@scripts/sandbox_deps.sh
	@$(PYTEST) $(XDIST) -m "not slow" $(PYTEST_ARGS)

# Django 6.1 (its built-in django.tasks, no django-tasks backport) in a second virtualenv, .venv-dj61: the
# Tasks and embedding tests on it, beside the whole suite on the pinned Django. Django 6 needs Python 3.12+.
DJ61_VENV ?= .venv-dj61
DJ61_DJANGO ?= 6.1.3
DJ61_PY := $(DJ61_VENV)/bin/python
DJ61_STAMP := $(DJ61_VENV)/.installed-$(shell cat requirements.txt | md5sum | cut -c1-8)-$(DJ61_DJANGO)
DJ61_TESTS ?= tests/jobs/test_tasks_backend.py tests/jobs/test_tasks_contract.py tests/system/test_embedded_site.py

$(DJ61_STAMP): requirements.txt
	@test -x $(DJ61_PY) || { \
	  py=$$(for c in python3.13 python3.12 $$(ls -d $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3 2>/dev/null); do \
	    $$c -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$c; break; }; done); \
	  test -n "$$py" || { echo "Django 6.1 needs Python 3.12 or newer: none found (python3.12, python3.13, pyenv)"; exit 1; }; \
	  $$py -m venv $(DJ61_VENV); }
	@echo "installing Python packages into $(DJ61_VENV) (requirements.txt with Django $(DJ61_DJANGO), no django-tasks)"
	@grep -v -i -E '^(django|django-tasks)==' requirements.txt > $(DJ61_VENV)/requirements.txt
	@echo "Django==$(DJ61_DJANGO)" >> $(DJ61_VENV)/requirements.txt
	@$(DJ61_VENV)/bin/pip install -q --disable-pip-version-check -r $(DJ61_VENV)/requirements.txt
	@rm -f $(DJ61_VENV)/.installed-* && touch $(DJ61_STAMP)

test-dj61: $(DJ61_STAMP)
	@scripts/browser_deps.sh
	@$(DJ61_PY) -m pytest $(DJ61_TESTS) $(PYTEST_ARGS)

bench: db
	@$(PY) bench/run.py

# Tasks through the engine while retention prunes them (docs/retention.md): claim rate and table sizes at
# the start and the end, bench/results/churn.json. CHURN_TASKS (2,000,000) sets the size, CHURN_SHORT=1 a smoke run.
bench-churn: db
	@$(PY) bench/churn.py

# One claim of a keyed service against the same service without limits (and without a key path), over four layouts of the
# backlog (the last round's 50 full keys of 1,000 over 100,000 tasks, interleaved and grouped; 800 of
# 1,000 keys full over 50,000; 2,000 of 10,000 over 50,000): bench/results/keyed_claim.json
# (bench/keyed_claim.py). KEYED_LAYOUTS=full-800,many-keys picks some.
bench-keyed: db
	@$(PY) bench/keyed_claim.py

# A paused tenant's 50,000 queued tasks at the head of the order against no pause: what the others'
# claims pay for it (free and host-bound backlogs): bench/results/paused_claim.json (bench/paused_claim.py).
bench-paused: db
	@$(PY) bench/paused_claim.py

# The claim of 64 tasks with 100,000 queued, in a fresh database and beside a finished history (10M events and
# their jobs, tasks and attempts; about 10 minutes to write on 2 cores): p50/p95 and the ratio history ÷ fresh,
# bench/results/history_claim.json (bench/history_claim.py). HISTORY_ARGS="--id-scheme both --events 2000000"
# compares the time-ordered ids with the old random ones on a smaller history.
bench-history: db
	@$(PY) bench/history_claim.py $(HISTORY_ARGS)

# The cockpit at scale (docs/performance.md): 1M jobs / 1.5M tasks / 10M events into the accs_scale database
# (once, about 11 minutes on 2 cores; COCKPIT_ARGS="--jobs 200000 --events 2000000" for less), then every
# admin page, the API and /metrics timed from a fresh web process (p50/p95 per page).
bench-cockpit-data: db
	@nice -n 10 $(PY) bench/cockpit_data.py $(COCKPIT_ARGS)

bench-cockpit-pages: db
	@$(PY) bench/cockpit_pages.py $(COCKPIT_PAGES_ARGS)

# The peers (../shared/bench-peers, one repetition, on a copy) and ACCS in one session:
# bench/results/compare.json and the README's benchmark table.
bench-compare: db
	@$(PY) bench/compare.py

# The fault scenario against real processes (chaos/README.md); CHAOS_TASKS=300 for a short run.
chaos: install
	@$(PY) chaos/run.py $(if $(CHAOS_TASKS),--tasks $(CHAOS_TASKS),)

# The previous release (PREVIOUS_RELEASE, a git revision) live under a job stream, upgraded to this tree in
# docs/deploy.md's order on a private cluster (bench/upgrade_drill.py); DRILL_ROLLBACK=1 also rolls it back.
PREVIOUS_RELEASE ?= 8a12ebc
upgrade-drill: install
	@PREVIOUS_RELEASE=$(PREVIOUS_RELEASE) $(PY) bench/upgrade_drill.py $(DRILL_ARGS)

check: install
	@$(PY) manage.py makemigrations --check --dry-run

# The test workers' clusters too (.local/pg-gw*: a run stops its own, unless it was killed).
stop:
	@scripts/pgbouncer_local.sh stop
	@scripts/pg_replica_local.sh stop
	@scripts/pg_local.sh stop
	@for dir in $(wildcard .local/pg-gw*[0-9]); do \
	  ACC_PG_DIR=$$dir scripts/pg_replica_local.sh stop 2>/dev/null; ACC_PG_DIR=$$dir scripts/pg_local.sh stop 2>/dev/null; done; true
	@scripts/s3_local.sh stop
