# syntax=docker/dockerfile:1
# vLLM's own image plus the kvtether connector, for the prefill and decode pods (the build
# context is the repository root):
#   docker build -f deploy/images/vllm.Dockerfile \
#     -t registry.example.com/kvtether/vllm-openai:v0.32.0-kvtether0.1.0 .
# VLLM_VERSION must be kvtether.connector._compat.TARGET_VLLM_VERSION: the connector refuses
# to load on any other version (the last step below checks it at build time).
ARG VLLM_VERSION=0.32.0
FROM vllm/vllm-openai:v${VLLM_VERSION}

COPY pyproject.toml README.md /tmp/kvtether/
COPY src /tmp/kvtether/src
# kvtether's few dependencies (pydantic, pydantic-settings, httpx, cachetools) must fit what
# vLLM ships: every package already installed is pinned as a constraint, so the install fails
# rather than moves one of vLLM's. No extras: the connector needs neither router nor stack.
RUN uv pip freeze --system | grep '==' > /tmp/vllm-constraints.txt \
 && uv pip install --system --constraint /tmp/vllm-constraints.txt /tmp/kvtether \
 && rm -rf /tmp/kvtether /tmp/vllm-constraints.txt \
 && python3 -c "from kvtether.connector import check_vllm_version as c; print('vLLM', c())"
