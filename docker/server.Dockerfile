# codraft server for NVIDIA GPUs: vLLM (CUDA build) + codraft, running `codraft serve`.
#
#   docker build -f docker/server.Dockerfile -t codraft-server:0.1.0 .
#
# PyPI's CUDA wheels of torch carry their own CUDA libraries, so the image needs only the host's
# NVIDIA driver, which the NVIDIA container runtime mounts. Versions are pinned below;
# docker/lint.py lints this file and tests/test_k8s.py keeps the pins in step with the others.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- build: a virtual environment with vLLM and codraft --------------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG VLLM_VERSION=0.26.0
# vllm==0.26.0 pins this torch; the constraint keeps any codraft dependency from moving it.
ARG TORCH_VERSION=2.11.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN echo "torch==${TORCH_VERSION}" > /opt/constraints.txt \
 && pip install --no-cache-dir -c /opt/constraints.txt "vllm==${VLLM_VERSION}"
# codraft last, so a source change rebuilds only this layer.
COPY pyproject.toml README.md /src/
COPY codraft /src/codraft
COPY server /src/server
COPY learner /src/learner
COPY client /src/client
RUN pip install --no-cache-dir -c /opt/constraints.txt /src

# ---- runtime: the same Python, the environment, no compilers but the one Triton needs --------
FROM ${PYTHON_IMAGE}
# tini: PID 1 that reaps vLLM's engine processes and passes SIGTERM on (so streams can drain).
# gcc + libc6-dev: Triton compiles a small C launcher the first time it runs a kernel.
# libc6-dev is not pinned: it must equal the base image's libc6, which the image tag fixes.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini=0.19.0-1+b3 gcc=4:12.2.0-3 libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin codraft
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    VLLM_NO_USAGE_STATS=1
USER 10001:10001
WORKDIR /home/codraft
EXPOSE 8000 8001
ENTRYPOINT ["tini", "--"]
CMD ["codraft", "serve", "--help"]
