# syntax=docker/dockerfile:1
# The ckptstore image every ckptstore service of docker-compose.yml runs (docs/DEPLOYMENT.md).
#
#   docker build -t ckptstore:0.1.0 .                                # CPU torch (default)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 ...
#
# Stage 1 builds the ckptstore wheel from the source tree; stage 2 installs torch from
# TORCH_INDEX_URL first (pinned; the CPU index by default: on x86-64 the default index's torch
# is the multi-GB CUDA build), then the wheel with the extras the services need, under
# constraints.txt (the versions the test suite ran with). No source tree at run time: the
# services run the installed package and the scripts copied to /app/scripts/stack.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG CKPT_EXTRAS=s3,postgres,flows,ui,safetensors
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY constraints.txt /tmp/constraints.txt
COPY --from=builder /wheels/ /tmp/wheels/
# torch==TORCH_VERSION again: the already installed build (e.g. 2.13.0+cpu) satisfies it, so
# nothing here can swap it for the default index's build.
RUN pip install -c /tmp/constraints.txt "torch==${TORCH_VERSION}" \
        "$(ls /tmp/wheels/ckptstore-*.whl)[${CKPT_EXTRAS}]" \
    && rm -rf /tmp/wheels /tmp/constraints.txt \
    && python -c "import torch, ckptstore; print('torch', torch.__version__)"
RUN groupadd --system --gid 10001 ckpt \
    && useradd --system --uid 10001 --gid ckpt --create-home --home-dir /home/ckpt ckpt \
    && mkdir -p /data/ckpt /data/hot \
    && chown ckpt:ckpt /data/ckpt /data/hot
WORKDIR /app
COPY scripts/stack/ /app/scripts/stack/
USER ckpt
CMD ["ckpt", "--help"]
