#!/usr/bin/env bash
# Fetch kv-cache-tester's recorded Claude Code traces (Apache-2.0; 739 conversations, token
# counts and block hashes, no text) at a pinned commit into DIR (default
# .kvtether/traces/kv-cache-tester). Not used by tests or the demo: they read the converted
# subset in tests/fixtures/traces/. Then, for example:
#   kvtether bench traces DIR/traces --predict
#   kvtether bench --profile cpu-agents --scenario DIR/traces
set -euo pipefail
DIR=${1:-.kvtether/traces/kv-cache-tester}
REPO=https://github.com/callanjfox/kv-cache-tester
COMMIT=94f6046dfd9c0c8bc0cdb24a5aa6579bac8669bf
if [ "$(git -C "$DIR" rev-parse HEAD 2>/dev/null || true)" = "$COMMIT" ]; then
  echo "[traces] $DIR is at $COMMIT"; exit 0
fi
mkdir -p "$DIR"
git -C "$DIR" init -q
git -C "$DIR" fetch -q --depth 1 "$REPO" "$COMMIT"
git -C "$DIR" checkout -q --detach FETCH_HEAD
echo "[traces] $(ls "$DIR"/traces/*.json | wc -l) traces in $DIR/traces ($REPO at $COMMIT, Apache-2.0)"
