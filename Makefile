# One-command entry points. Each target creates .venv and installs everything on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
QUICK_FLAG := $(if $(filter 1 true yes,$(QUICK)),--quick,)
# Cloud images and containers often log in as root, which JupyterLab refuses without this flag.
ROOT_FLAG  := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab course test student doctor lint benchmark clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/pip install -r requirements-dev.txt
	$(BIN)/pip install --no-deps -e .
	touch $(STAMP)

lab: $(STAMP)  ## JupyterLab on the lessons
	$(BIN)/jupyter lab $(ROOT_FLAG) notebooks/

course: $(STAMP)  ## run every lesson headless (QUICK=1 for quick mode); report in build/course/
	$(BIN)/mgpu course $(QUICK_FLAG)

test: $(STAMP)  ## lint, unit tests, distributed tests, every notebook in quick mode
	$(BIN)/ruff check .
	$(BIN)/pytest

student: $(STAMP)  ## student edition (solutions stubbed) in build/student/
	$(BIN)/mgpu student

doctor: $(STAMP)  ## environment report
	$(BIN)/mgpu doctor

benchmark: $(STAMP)  ## the speed targets, measured side by side
	$(BIN)/python benchmarks/loop_overhead.py
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/pipeline.py

clean:
	rm -rf build .pytest_cache
