"""Write ``bench/results/archive/INDEX.md``: one row per archived result file (file, the commit
that measured it, its date, the command that reproduces it, the claim it backed).

``bench/results/`` holds the results that a generated block or a make target reads; earlier
runs (named per commit or seed, experiments behind one claim of a closing note) live in
``archive/``. Everything in a row comes from the file and the repository, nothing is typed: the
commit is the hash in the name (else the commit that added the file), the date is that commit's,
the command is rebuilt from a chaos summary's ``config`` (other files: the commit subject says
which script made it), and the claim is the subject of the commit that added the file.

    python bench/archive_index.py            # rewrite the index
    python bench/archive_index.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT / "bench" / "results" / "archive"
INDEX = ARCHIVE / "INDEX.md"
HASH = re.compile(r"_([0-9a-f]{7})(?=\.)")


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip()


def _added(path: Path) -> tuple[str, str, str]:
    """(commit, date, subject) of the commit that added ``path`` (under its old name too)."""
    rel = str(path.relative_to(ROOT))
    line = _git("log", "--follow", "--diff-filter=A", "--format=%h|%ad|%s", "--date=short", "--", rel)
    last = line.splitlines()[-1] if line else "||"
    commit, date, subject = (last.split("|", 2) + ["", ""])[:3]
    return commit, date, subject


def _command(path: Path) -> str:
    if ".phases." in path.name:
        stem = path.name.split(".phases.")[0]
        return f"`python -m tests.chaos.phases {stem}.json` (the phase breakdown of that campaign)"
    if path.suffix != ".json":
        return "the campaign's output (the JSON of the same name)"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    c = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(c, dict) or "seed" not in c:
        return ""
    cmd = (f"python -m tests.chaos.campaign --seed {c['seed']} --faults {c.get('faults')} "
           f"--kinds {','.join(c.get('kinds', []))} --topology {c.get('nodes')}x{c.get('nproc_per_node', 1)}")
    if c.get("in_process"):
        cmd += " --in-process"
    if c.get("redundancy", "replica") != "replica":
        cmd += f" --redundancy {c['redundancy']}"
    if c.get("spares"):
        cmd += f" --spares {c['spares']}"
    if c.get("mesh", "fsdp") != "fsdp":
        cmd += f" --mesh {c['mesh']}"
    if c.get("node_relay"):
        cmd += " --node-relay"
    return f"`{cmd}`"


def render() -> str:
    rows = []
    for f in sorted(p for p in ARCHIVE.iterdir() if p.is_file() and p != INDEX):
        commit, date, subject = _added(f)
        m = HASH.search(f.name)
        measured = m.group(1) if m else commit
        rows.append(f"| `{f.name}` | {measured} | {date} | {_command(f)} | {subject.replace('|', '/')} |")
    return ("# Archived results\n\n"
            "Earlier runs, kept for the closing notes that cite them; the results that generated "
            "blocks and make targets read are in `bench/results/`. Written by "
            "`python bench/archive_index.py` from the files and the repository's history.\n\n"
            "| file | commit measured | date | command | the commit that added it |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the index is out of date")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        ok = INDEX.exists() and INDEX.read_text() == text
        if not ok:
            print(f"{INDEX} is out of date: run python bench/archive_index.py", file=sys.stderr)
        return 0 if ok else 1
    INDEX.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
