# Every target creates .venv and installs the package (editable, with the test and docs extras,
# pinned by constraints.txt) when that has not been done yet, so each works on a fresh clone.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
QUICKSTART := cli_configs/quickstart.yaml
# pytest-xdist workers for the test targets: one per core by default (each worker and the
# processes it starts use one thread; see tests/conftest.py).
TEST_WORKERS ?= auto

.PHONY: install demo test test-slow docs bench bench-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,docs]'
	touch $(STAMP)

demo: install
	$(BIN)/ada fit -c $(QUICKSTART)
	$(BIN)/ada test -c $(QUICKSTART) --ckpt_path last

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -n $(TEST_WORKERS) -m "not slow" --durations=20

test-slow: install
	$(BIN)/pytest -n $(TEST_WORKERS) -m slow --durations=20

docs: install
	$(BIN)/mkdocs build --strict

bench: install
	@test -n "$(NAME)" || { echo "usage: make bench NAME=<technique slug>"; exit 2; }
	@test -f bench/$(NAME).py || { echo "no benchmark script bench/$(NAME).py"; exit 2; }
	$(BIN)/python bench/$(NAME).py

bench-gpu: install
	@test -n "$(NAME)" || { echo "usage: make bench-gpu NAME=<technique slug>"; exit 2; }
	@test -f bench/gpu/$(NAME).py || { echo "no GPU benchmark script bench/gpu/$(NAME).py"; exit 2; }
	$(BIN)/python bench/gpu/$(NAME).py

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache runs sweeps
