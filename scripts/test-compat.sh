#!/usr/bin/env bash
# The framework integrations against the oldest and the newest release of every framework
# range their pyproject.toml declares: for each integration and each end, a throwaway
# virtualenv with the core's and the integration's requirements, the frameworks pinned to the
# oldest release in range (oldest end) or resolved by pip to the newest installable ones
# (newest end: what a fresh install gets; a newer release pip cannot install is named), and
# the integration's unit tests (-m "not vllm and not soak"). The project's .venv is never
# touched, and nothing is built or installed from the working tree (kvtether and the
# integration run from their src/ through PYTHONPATH).
#
#   scripts/test-compat.sh                          # both integrations, both ends
#   scripts/test-compat.sh openai-agents            # one integration
#   BOUNDS=oldest scripts/test-compat.sh langgraph  # one end
#
# Env: PYTHON (Python >= 3.11 to make the virtualenvs from; python3), COMPAT_DIR (where they go;
# a fresh temporary directory, removed at the end unless KEEP=1), PYTEST_ARGS (extra pytest
# arguments). Needs the package index (pip's usual configuration); 25-40 s per virtualenv, about
# two minutes for all four, on a 2-core machine with a warm pip cache. Exits non-zero if any
# run fails.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
BOUNDS=${BOUNDS:-oldest newest}
if [ $# -gt 0 ]; then INTEGRATIONS=("$@"); else INTEGRATIONS=(langgraph openai-agents); fi

# The distributions whose declared ranges are tested, per integration.
frameworks() {
  case $1 in
    langgraph) echo "langchain langchain-core langchain-openai langgraph" ;;
    openai-agents) echo "openai-agents" ;;
    *) echo "[compat] unknown integration '$1' (langgraph, openai-agents)" >&2; return 1 ;;
  esac
}

# Libraries pinned too at the oldest end, to the lowest release the oldest framework releases
# allow (as they were when those came out): left to pip, their newest releases break those
# frameworks whatever kvtether does (openai-agents 0.4 builds openai's usage types without a
# field later openai 2.x require; langgraph-prebuilt after 1.0.0 imports from langgraph what
# no langgraph 1.0.x has), which a plain `pip install openai-agents==0.4.0` hits too.
companions() {
  case $1 in
    langgraph) echo "langgraph-prebuilt" ;;
    openai-agents) echo "openai" ;;
  esac
}

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "[compat] PYTHON=$PYTHON is older than 3.11 (the integrations need 3.11)" >&2; exit 2; }
for integration in "${INTEGRATIONS[@]}"; do frameworks "$integration" >/dev/null; done

if [ -n "${COMPAT_DIR:-}" ]; then
  mkdir -p "$COMPAT_DIR"
else
  COMPAT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvtether-compat.XXXXXX")
  [ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$COMPAT_DIR"' EXIT
fi

# Prints the requirements of one run, one per line: the core's (with its router extra, for the
# fake router the tests serve) and the integration's; at the oldest end each framework pinned
# to the oldest release the index has in its declared range, and each companion library to the
# lowest release the pinned frameworks and the integration allow. At the newest end, lines
# "#newest DIST==VERSION" name the newest release in range on the index (not passed to pip).
requirements() {  # VENV_PYTHON INTEGRATION BOUND "FRAMEWORK..." "COMPANION..."
  "$1" - "$ROOT" "${@:2}" <<'EOF'
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

root, integration, bound, frameworks, companions = sys.argv[1:]
core = tomllib.loads(Path(root, "pyproject.toml").read_text())["project"]
project = tomllib.loads(
    Path(root, "integrations", integration, "pyproject.toml").read_text())["project"]
reqs = [*core["dependencies"], *core["optional-dependencies"]["router"],
        *(r for r in project["dependencies"] if Requirement(r).name != "kvtether")]
declared = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
pip = [sys.executable, "-m", "pip"]


def pick(dist: str, spec: SpecifierSet, lowest: bool) -> str:
    """dist==the lowest (or highest) final release on the index in spec."""
    out = subprocess.run([*pip, "index", "versions", dist],
                         check=True, capture_output=True, text=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("Available versions:"))
    versions = []
    for text in line.split(":", 1)[1].split(","):
        try:
            versions.append(Version(text.strip()))
        except InvalidVersion:
            pass
    fits = sorted(v for v in versions if not v.is_prerelease and v in spec)
    if not fits:
        sys.exit(f"[compat] the index has no {dist} release in '{spec}'")
    return f"{dist}=={fits[0] if lowest else fits[-1]}"


def requires(pinned: str) -> list[Requirement]:
    """The requirements (no extras) a pinned release declares, read by pip from the index."""
    out = subprocess.run([*pip, "install", "--dry-run", "--no-deps", "--ignore-installed", "-q",
                          "--report", "-", pinned], check=True, capture_output=True, text=True)
    (item,) = json.loads(out.stdout)["install"]
    found = [Requirement(r) for r in item["metadata"].get("requires_dist") or []]
    return [r for r in found if r.marker is None or r.marker.evaluate({"extra": ""})]


for dist in frameworks.split():
    if dist not in declared:
        sys.exit(f"[compat] {integration}'s pyproject.toml declares no range for {dist}")
if bound == "oldest":
    pins = [pick(dist, declared[dist].specifier, lowest=True) for dist in frameworks.split()]
    theirs = [r for pin in pins for r in requires(pin)]
    for dist in companions.split():
        spec = SpecifierSet()
        for r in theirs + ([declared[dist]] if dist in declared else []):
            if r.name == dist:
                spec &= r.specifier
        pins.append(pick(dist, spec, lowest=True))
    reqs += pins
else:
    reqs += [f"#newest {pick(d, declared[d].specifier, lowest=False)}" for d in frameworks.split()]
print("\n".join(reqs))
EOF
}

# Prints DIST==VERSION of each distribution named, as installed in the virtualenv.
installed() {  # VENV_PYTHON DIST...
  "$1" -c 'import sys; from importlib.metadata import version
print(" ".join(f"{d}=={version(d)}" for d in sys.argv[1:]))' "${@:2}"
}

declare -a RESULTS=()
failed=0
for integration in "${INTEGRATIONS[@]}"; do
  for bound in $BOUNDS; do
    venv="$COMPAT_DIR/$integration-$bound"
    log="$COMPAT_DIR/$integration-$bound.log"
    start=$SECONDS
    echo "[compat] $integration, $bound: virtualenv $venv"
    rm -rf "$venv"
    status=ok
    notes=""
    {
      "$PYTHON" -m venv "$venv" &&
      "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.3" packaging &&
      mapfile -t lines < <(requirements "$venv/bin/python" "$integration" "$bound" \
        "$(frameworks "$integration")" "$(companions "$integration")") &&
      [ ${#lines[@]} -gt 0 ] &&
      reqs=() && newest=() &&
      for line in "${lines[@]}"; do
        case $line in "#newest "*) newest+=("${line#\#newest }") ;; *) reqs+=("$line") ;; esac
      done &&
      echo "[compat] requirements: ${reqs[*]}" &&
      "$venv/bin/python" -m pip install -q --disable-pip-version-check "${reqs[@]}"
    } >"$log" 2>&1 || status="install failed"
    versions=""
    if [ "$status" = ok ]; then
      # shellcheck disable=SC2046
      versions=$(installed "$venv/bin/python" $(frameworks "$integration") \
        $([ "$bound" = oldest ] && companions "$integration"))
      for want in "${newest[@]}"; do
        [[ " $versions " == *" $want "* ]] || notes+=" $want on the index is not installable here;"
      done
      # From the repository root, under its pytest settings: the tests import the core's
      # tests.support (the fake router).
      (cd "$ROOT" && PYTHONPATH="$ROOT/src:$ROOT/integrations/$integration/src" \
        "$venv/bin/python" -m pytest "integrations/$integration/tests" \
        -m "not vllm and not soak" -q -p no:cacheprovider ${PYTEST_ARGS:-}) >>"$log" 2>&1 \
        || status="tests failed"
    fi
    summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$log" | tail -1 | tr -d '=' | xargs || true)
    line="$integration $bound [$versions]: $status${summary:+ ($summary)}, $((SECONDS - start)) s"
    [ -z "$notes" ] || line+=" (note:${notes%;})"
    RESULTS+=("$line")
    echo "[compat] $line"
    if [ "$status" != ok ]; then
      failed=1
      echo "[compat] last lines of $log:"
      tail -n 30 "$log" | sed 's/^/    /'
    fi
  done
done

echo "[compat] summary:"
printf '    %s\n' "${RESULTS[@]}"
[ "${KEEP:-0}" != 1 ] || echo "[compat] kept: $COMPAT_DIR"
exit "$failed"
