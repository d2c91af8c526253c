# syntax=docker/dockerfile:1
# The kvtether router, built from this checkout (the build context is the repository root):
#   docker build -f deploy/images/router.Dockerfile -t registry.example.com/kvtether/router:0.1.0 .
# Only the router's dependencies (kvtether[router]); no vLLM, no GPU libraries.
# Pin the base by digest in your registry for reproducible builds.
FROM python:3.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY pyproject.toml README.md /tmp/kvtether/
COPY src /tmp/kvtether/src
RUN pip install "/tmp/kvtether[router]" && rm -rf /tmp/kvtether \
 && kvtether router --help > /dev/null

# Matches runAsUser in deploy/kubernetes/router.yaml; the root filesystem is mounted read-only.
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvtether"]
CMD ["router"]
