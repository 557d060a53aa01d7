"""The documentation holds together: every relative link in the README and under docs/ resolves
(the file exists; an anchor names a heading of that file), and the README stays a short
teaching page (issue 41: at most 300 lines; the rest lives in docs/guides/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # unit / single-process: make test-quick

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!\\)!?\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    """The page without fenced code blocks and inline code spans."""
    out, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    out, fence = set(), False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = re.match(r"^#{1,6} (.*)$", line)
        if m and not fence:
            out.add(slug(m.group(1)))
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(_outside_code(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked (no network here)
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def test_every_relative_link_resolves() -> None:
    assert len(PAGES) > 5
    bad = [b for p in PAGES for b in broken_links(p)]
    assert not bad, "\n".join(bad)


def test_the_checker_finds_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    (tmp_path / "there.md").write_text("# A `code` heading: yes\n")
    page.write_text("[ok](there.md#a-code-heading-yes) [gone](missing.md) [nohead](there.md#nope)\n"
                    "```\n[in code](ignored.md)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links(page) == ["p.md: missing.md (no such file)",
                                      "p.md: there.md#nope (no such heading)"]
    finally:
        ROOT = saved


def test_the_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines: move detail into docs/guides/"


def test_every_environment_variable_is_in_the_readme_table() -> None:
    used = set()
    for path in (ROOT / "aegis").rglob("*.py"):
        used |= set(re.findall(r"\bAEGIS_[A-Z0-9_]+[A-Z0-9]\b", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Environment variables"):]
    missing = sorted(v for v in used if f"`{v}`" not in table)
    assert not missing, f"AEGIS_* variables read by aegis/ but not in the README's table: {missing}"


@pytest.mark.timeout(300)
def test_the_api_reference_builds_without_a_warning(tmp_path: Path) -> None:
    """``make docs``: mkdocs --strict over the guides and the API reference generated from the
    docstrings; a docstring griffe cannot parse, a page missing from the nav or a broken link
    inside docs/ is a warning, and fails the build. The reference has every public name."""
    import subprocess
    import sys

    import aegis

    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "WARNING" not in out.stderr, out.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in [*aegis.__all__, "open"]:
        assert f'id="aegis.{name}"' in api, name
