"""The documentation: README.md and every page under docs/ stay readable and connected.

Every fenced ```python block parses (a block meant as a fragment is preceded by the line
`<!-- fragment -->` and skipped), every relative Markdown link points to a file or folder of
the repository, and README.md stays a five-minute read that starts with the two commands.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250
FRAGMENT_MARK = "<!-- fragment -->"

PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
# [text](target) and ![alt](target); the target may be <...> and may carry a "title".
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(?P<target><[^>]*>|[^)\s]+)")
# [label]: target (reference definitions)
_REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(?P<target><[^>]*>|\S+)", re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _split(text: str) -> tuple[list[tuple[int, str, str]], str]:
    """The fenced blocks (start line, info string, body) and the prose with them blanked."""
    blocks: list[tuple[int, str, str]] = []
    prose: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            prose.append(lines[i])
            i += 1
            continue
        fence = opening["fence"]
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            closing = _FENCE.match(lines[i])
            if (
                closing is not None
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            body.append(lines[i])
            i += 1
        blocks.append((start, opening["info"].strip(), "\n".join(body)))
        prose.extend([""] * (i + 1 - start))
        i += 1
    return blocks, "\n".join(prose)


def _python_blocks():
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").split("\n")
        blocks, _ = _split("\n".join(lines))
        for start, info, body in blocks:
            if info.split()[:1] != ["python"]:
                continue
            before = [line.strip() for line in lines[:start] if line.strip()]
            if before and before[-1] == FRAGMENT_MARK:
                continue
            yield pytest.param(page, start + 1, body, id=f"{_rel(page)}:{start + 1}")


def _links(page: Path) -> list[str]:
    _, prose = _split(page.read_text(encoding="utf-8"))
    prose = _CODE_SPAN.sub("", prose)
    targets = [m["target"] for m in _INLINE_LINK.finditer(prose)]
    targets += [m["target"] for m in _REFERENCE_LINK.finditer(prose)]
    return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in targets]


def _is_relative(target: str) -> bool:
    return not (
        re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)  # http:, https:, mailto:, ...
        or target.startswith("//")
        or target.startswith("#")
        or not target
    )


@pytest.mark.parametrize(("page", "line", "source"), list(_python_blocks()))
def test_python_blocks_parse(page, line, source):
    try:
        ast.parse(source)
    except SyntaxError as e:
        pytest.fail(
            f"{_rel(page)}, the ```python block at line {line}: {e.msg} (its line {e.lineno}); "
            f"make it parse (`...` is valid Python) or mark it {FRAGMENT_MARK!r}"
        )


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_point_to_files(page):
    broken = []
    for target in _links(page):
        if not _is_relative(target):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (page.parent / path).resolve()
        if not resolved.exists():
            broken.append(target)
        elif ROOT not in (resolved, *resolved.parents):
            broken.append(f"{target} (outside the repository)")
    assert not broken, f"{_rel(page)} links to what is not in the repository: {broken}"


def test_the_link_check_sees_links():
    # A guard for the checks above: a regex that found nothing would pass every page.
    assert "docs/cli.md" in _links(README)
    assert any(
        body for page in PAGES for _, info, body in _split(page.read_text())[0] if info == "python"
    )


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference "
        "material into a page under docs/ and link it from the README's Reference list"
    )


def test_readme_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").split("\n")
    assert lines[0] == "# kvtether"
    body = [line for line in lines[1:] if line.strip()]
    assert body[0] == "```bash", "README.md must start with the two commands, in a bash block"
    assert body[1].startswith("make demo")
    assert body[2].startswith("make test")
    assert body[3] == "```"


def _documented_modules() -> dict[str, set[str]]:
    """docs/architecture.md's source-layout table: package -> the module names its row names."""
    rows: dict[str, set[str]] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            package = cells[0].strip("`").rstrip("/")
            described = cells[1]
            while (shorter := re.sub(r"\([^()]*\)", "", described)) != described:
                described = shorter  # what a module holds, in parentheses, names no module
            rows[package] = set(re.findall(r"`([\w.-]+)`", described))
    return rows


def test_the_architecture_page_names_every_module() -> None:
    # docs/architecture.md is where a new maintainer starts: a module it omits is one they
    # will not find, a name it keeps after a module left misleads them.
    rows = _documented_modules()
    src = ROOT / "src" / "kvtether"
    assert "router" in rows and "connector" in rows
    wrong = []
    for package, named in rows.items():
        if package == "protocol":
            continue  # one package, described as a whole
        files = {p.stem for p in (src / package).glob("*.py")} - {"__init__", "__main__"}
        files |= {p.name for p in (src / package).glob("*.js")}
        files |= {p.name for p in (src / package).iterdir() if (p / "__init__.py").exists()}
        wrong += [f"{package}/{m}: not in the table" for m in sorted(files - named)]
        wrong += [f"{package}/{m}: no such module" for m in sorted(named - files)]
    missing = sorted(p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists()
                     and p.name not in rows)
    assert not wrong and not missing, "\n".join(wrong + [f"{m}/: no row" for m in missing])
