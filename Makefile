# One-command entry points. Each target creates .venv and installs everything on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
QUICK_FLAG := $(if $(filter 1 true yes,$(QUICK)),--quick,)
# make course PARAMS="EPOCHS=1 DATASET=digits" ONLY="00 02": one --param per NAME=VALUE word.
PARAM_FLAGS := $(foreach p,$(PARAMS),--param $(p))
ONLY_FLAG  := $(if $(ONLY),--only $(ONLY),)
# nbgrader 0.9 for the autograding test, in its own environment (not in requirements.txt).
GRADING       := .venv-grading
GRADING_STAMP := $(GRADING)/.installed
# Cloud images and containers often log in as root, which JupyterLab refuses without this flag.
ROOT_FLAG  := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: envs lab course test test-long test-settings test-fast student doctor lint benchmark budget grading-env clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/pip install -r requirements-dev.txt
	$(BIN)/pip install --no-deps -e .
	touch $(STAMP)

# JupyterLab defaults for the course: widget state saved with the notebook, so sliders still
# draw when a saved lesson is reopened without a running kernel (lesson 00 explains).
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json

$(LAB_SETTINGS): jupyter/overrides.json $(STAMP)
	mkdir -p $(dir $@)
	cp jupyter/overrides.json $@

lab: $(STAMP) $(LAB_SETTINGS)  ## JupyterLab on the lessons
	$(BIN)/jupyter lab $(ROOT_FLAG) notebooks/

course: $(STAMP)  ## run every lesson headless (QUICK=1, PARAMS="EPOCHS=1 ...", ONLY="00 02")
	$(BIN)/mgpu course $(QUICK_FLAG) $(ONLY_FLAG) $(PARAM_FLAGS)

$(GRADING_STAMP):
	test -x $(GRADING)/bin/python || $(PYTHON) -m venv $(GRADING)
	$(GRADING)/bin/pip install "nbgrader==0.9.*"
	touch $(GRADING_STAMP)

grading-env: $(GRADING_STAMP)  ## nbgrader 0.9 in .venv-grading (make test uses it)

# Both environments of make test, installed side by side: pip works mostly on one core.
envs:
	$(MAKE) -j2 $(STAMP) $(GRADING_STAMP)

test: envs  ## lint, unit tests, every notebook in quick mode, nbgrader
	$(BIN)/ruff check .
	MGPU_NBGRADER=$(abspath $(GRADING))/bin/nbgrader $(BIN)/pytest -m "not settings and not slow"

# What make test leaves out to stay a quick loop (CI runs it after make test): every lesson on its
# other settings, and the end-to-end runs marked slow (benchmarks' quick runs, torchrun jobs,
# lessons as scripts, larger world sizes).
test-long: $(STAMP)  ## the settings runs and the slow end-to-end tests
	$(BIN)/pytest -m "settings or slow"

# Every lesson again on each other DATASET and MODEL its parameters cell offers (CI runs it too).
test-settings: $(STAMP)  ## every lesson on each DATASET/MODEL setting, quick mode
	$(BIN)/pytest -m settings tests/test_notebooks.py

test-fast: $(STAMP)  ## lint and unit tests, no notebooks and no nbgrader (for iterating)
	$(BIN)/ruff check .
	$(BIN)/pytest -m "not notebook and not slow" --ignore=tests/test_nbgrader.py

student: $(STAMP)  ## the student copy of the course (solutions stubbed) in build/student/
	$(BIN)/mgpu student

# The lesson budget (docs/authoring.md). RUN_TIMES=build/course/report.json, from a full-mode
# `make course`, adds each lesson's reading + run minutes beside the estimate it states.
RUN_TIMES_FLAG := $(if $(RUN_TIMES),--run-times $(RUN_TIMES),)

budget: $(STAMP)  ## every lesson against the lesson budget (RUN_TIMES=...: the honest estimate)
	$(BIN)/mgpu budget $(RUN_TIMES_FLAG)

doctor: $(STAMP)  ## environment report
	$(BIN)/mgpu doctor

# Every result (JSON, output, a picture each, summary.txt) in benchmarks/results/<host>-<date>/.
benchmark: $(STAMP)  ## the speed targets, measured side by side (QUICK=1: smoke runs)
	$(BIN)/python benchmarks/run_all.py $(QUICK_FLAG)

clean:
	rm -rf build .pytest_cache
