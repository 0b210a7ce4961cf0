# Two commands on a fresh clone: `make demo` and `make test`. Each sets itself up.
PY    ?= python3
VENV  ?= .venv
BIN   := $(VENV)/bin
# The CPU build of torch is installed first (a bare `torch` pulls a multi-GB CUDA build).
# On a GPU machine: make install TORCH=torch
TORCH ?= torch==2.13.0

.PHONY: install demo demo-rl test clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/llmtrain prepare-tiny assets/tiny
	$(BIN)/llmtrain finetune recipes/tiny.yaml --overwrite

# Online RL on the same task: a short SFT run leaves room to improve, then GRPO raises its answer accuracy.
demo-rl: install
	$(BIN)/llmtrain prepare-tiny assets/tiny
	$(BIN)/llmtrain finetune recipes/tiny.yaml train.max_steps=150 output_dir=runs/tiny-sft --overwrite
	$(BIN)/llmtrain finetune recipes/tiny-grpo.yaml --overwrite

# Two pytest-xdist workers, each running whole test files (a file's shared runs are made once), the long
# multi-process files first (tests/conftest.py); a plain `pytest -q` runs the same tests one after another.
test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf runs assets .cache
