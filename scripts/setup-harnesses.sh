#!/usr/bin/env bash
# Install the coding-agent harnesses the tests drive (Claude Code, Codex, OpenCode), pinned in
# scripts/harnesses/package.json, into DIR (default .kvtether/harnesses). Idempotent; needs
# only the npm registry (and Debian's, for ripgrep, which OpenCode runs). Called by `make test`.
set -euo pipefail
DIR=${1:-.kvtether/harnesses}
SRC="$(cd "$(dirname "$0")/harnesses" && pwd)"
command -v npm >/dev/null 2>&1 || {
  echo "[harnesses] npm not found: install Node.js 20+ (apt install nodejs npm)" >&2; exit 1; }
if ! command -v rg >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[harnesses] installing ripgrep (Debian package), which OpenCode needs"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q ripgrep >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q ripgrep >/dev/null; }
  else
    echo "[harnesses] no ripgrep: OpenCode needs rg on PATH" >&2
  fi
fi
mkdir -p "$DIR"
if cmp -s "$SRC/package.json" "$DIR/package.json" && [ -x "$DIR/node_modules/.bin/opencode" ]; then
  exit 0
fi
cp "$SRC/package.json" "$DIR/"
echo "[harnesses] installing Claude Code, Codex and OpenCode (npm)"
# Their postinstall scripts copy the native binaries the packages ship as optional
# dependencies into place; nothing is downloaded outside the registry.
(cd "$DIR" && npm install --no-audit --no-fund --no-package-lock --loglevel=error)
"$DIR/node_modules/.bin/claude" --version >/dev/null
"$DIR/node_modules/.bin/codex" --version >/dev/null
"$DIR/node_modules/.bin/opencode" --version >/dev/null
echo "[harnesses] ready: $DIR"
