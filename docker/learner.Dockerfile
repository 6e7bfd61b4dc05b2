# codraft learner for NVIDIA GPUs: PyTorch (CUDA build) + codraft, run under torchrun.
#
#   docker build -f docker/learner.Dockerfile -t codraft-learner:0.1.0 .
#
# The same torch as the server image (vllm==0.26.0 pins it), so drafts and NCCL behave alike on
# both sides. docker/lint.py lints this file; tests/test_k8s.py checks the pins.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- build -----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.11.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN echo "torch==${TORCH_VERSION}" > /opt/constraints.txt \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY codraft /src/codraft
COPY server /src/server
COPY learner /src/learner
COPY client /src/client
RUN pip install --no-cache-dir -c /opt/constraints.txt /src

# ---- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# tini: PID 1 that reaps torchrun's workers and passes SIGTERM on to torchrun.
# gcc + libc6-dev: Triton (torch.compile) compiles a small C launcher at run time.
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
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/codraft
EXPOSE 5557 9100 29400
ENTRYPOINT ["tini", "--"]
CMD ["codraft", "--help"]
