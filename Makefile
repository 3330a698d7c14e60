# One virtual environment for everything; torch==2.13.0 is installed first so that pip never
# pulls a multi-GB CUDA build of torch as a dependency (any torch >= 2.6 works otherwise).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DATA ?= .demo-data
export RAG_LOG_LEVEL ?= WARNING

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

## demo: ingest the project's own docs with the default model, search them, evaluate them
demo: setup
	rm -rf $(DEMO_DATA)
	RAG_DATA_DIR=$(DEMO_DATA) $(BIN)/rag-retriever ingest docs --collection demo
	RAG_DATA_DIR=$(DEMO_DATA) $(BIN)/rag-retriever search "how do I roll back a bad ingest?" --collection demo -k 3
	RAG_DATA_DIR=$(DEMO_DATA) $(BIN)/python eval/recall_at_k.py --collection demo \
		--questions eval/demo_questions.jsonl --k 1 3 5 --out $(DEMO_DATA)/eval

## test: lint, types, the import layers and the test suite (what CI runs)
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## bench: every benchmark, each against its peer measured in the same run (about an hour on 2 cores)
bench: setup
	$(BIN)/python -m bench --out bench-out

clean:
	rm -rf $(VENV) $(DEMO_DATA) bench-out .mypy_cache .ruff_cache .pytest_cache tour-data tour-eval faq.jsonl
