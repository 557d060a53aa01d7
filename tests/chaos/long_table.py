"""The table of issue 25's long in-process campaigns (``make chaos-long``): per fault kind and
redundancy scheme, the faults, invariant violations, hangs, and the median / p90 / max of the
time to resume (fault -> first trained step after the restore; apart, for the faults that
were restored from memory alone) and of the longest gap between two trained steps, read from the campaigns' summary JSONs. Writes ``bench/results/chaos_long.md``
and ``chaos_long.json``, puts the table into docs/guides/chaos.md between its ``chaos-long`` markers,
and prints it.

    python -m tests.chaos.long_table bench/results/chaos_3x2_seed11.json ...
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[2] / "bench" / "results"
RESUME_BOUND_S = 15.0  # issue 25: max resume for a fault that leaves a memory copy


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _stats(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.1f} / {_q(xs, 0.9):.1f} / {max(xs):.1f}"


def table(paths: list[Path]) -> tuple[str, dict[str, Any]]:
    runs = [json.loads(p.read_text()) for p in paths]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        scheme = f"{run['redundancy']} {run['topology']}"
        for r in run["records"]:
            groups.setdefault((r["kind"], scheme), []).append(r)
    lines = ["| fault kind | scheme | faults | violations | hangs | resume s (median / p90 / max) "
             "| of which from memory: n, resume s (median / p90 / max) "
             "| longest step gap s (median / p90 / max) | lost steps (max) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for (kind, scheme), recs in sorted(groups.items()):
        viol = sum(1 for r in recs for c in r["checks"] if not c[1])
        hangs = sum(1 for r in recs for c in r["checks"] if "did not resume" in c[0])
        resume = [r["resume_s"] for r in recs if r.get("resume_s") is not None]
        memory = [r["resume_s"] for r in recs if _from_memory(r)]
        gaps = [r["max_step_gap_s"] for r in recs if r.get("max_step_gap_s") is not None]
        lost = [r["lost_steps"] for r in recs if r.get("lost_steps") is not None]
        rows.append({"kind": kind, "scheme": scheme, "faults": len(recs), "violations": viol,
                     "hangs": hangs, "resume_s": resume, "memory_resume_s": memory,
                     "gaps_s": gaps, "lost": lost})
        lines.append(f"| {kind} | {scheme} | {len(recs)} | {viol} | {hangs} | {_stats(resume)} | "
                     f"{len(memory)}: {_stats(memory)} | "
                     f"{_stats(gaps)} | {max(lost) if lost else '-'} |")
    every = [r for run in runs for r in run["records"]]
    resume = [r["resume_s"] for r in every if r.get("resume_s") is not None]
    memory = [r for r in every if _from_memory(r)]
    total = {
        "campaigns": [{"file": str(p), "seed": run["seed"], "scheme": f"{run['redundancy']} "
                       f"{run['topology']}", "faults": run["faults_injected"],
                       "checks": run["checks"], "violations": len(run["violations"]),
                       "minutes": round(run["wall_s"] / 60, 1)} for p, run in zip(paths, runs,
                                                                                    strict=True)],
        "faults": len(every),
        "violations": sum(len(run["violations"]) for run in runs),
        "resume_median_s": statistics.median(resume) if resume else None,
        "resume_max_s": max(resume) if resume else None,
        "over_bound": [(r["kind"], r["index"], r["resume_s"]) for r in every
                       if r.get("resume_s") is not None and r["resume_s"] > RESUME_BOUND_S],
        "from_memory": len(memory),
        "memory_resume_median_s": statistics.median(
            [r["resume_s"] for r in memory]) if memory else None,
        "memory_over_bound": [(r["kind"], r["index"], round(r["resume_s"], 1)) for r in memory
                              if r["resume_s"] > RESUME_BOUND_S],
        "rows": rows,
    }
    lines += ["", f"{total['faults']} faults over {len(runs)} campaigns (seeds "
              f"{', '.join(str(run['seed']) for run in runs)}), "
              f"{sum(run['checks'] for run in runs)} checks, {total['violations']} invariant "
              f"violations; resume median {_fmt(total['resume_median_s'])} s, max "
              f"{_fmt(total['resume_max_s'])} s. Faults restored from memory alone (no rank "
              f"read the object store: a memory copy was left): {total['from_memory']}, resume "
              f"median {_fmt(total['memory_resume_median_s'])} s, over {RESUME_BOUND_S:.0f} s: "
              f"{total['memory_over_bound'] or 'none'}; all faults over {RESUME_BOUND_S:.0f} s: "
              f"{[(k, i, round(x, 1)) for k, i, x in total['over_bound']] or 'none'}."]
    return "\n".join(lines), total


def _from_memory(r: dict[str, Any]) -> bool:
    """A fault the job resumed from without reading the object store: every rank restored from
    its own node store, a peer's, or a parity rebuild (the faults issue 25's 15 s bound is for)."""
    return r.get("resume_s") is not None and bool(r.get("tiers")) and "durable" not in r["tiers"]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv if Path(a).exists()]
    missing = [a for a in argv if not Path(a).exists()]
    if not paths:
        print(f"no campaign results among {argv}", file=sys.stderr)
        return 2
    md, total = table(paths)
    if missing:
        md += f"\n\nNot run (no result file): {', '.join(missing)}."
    (OUT / "chaos_long.md").write_text(md + "\n")
    (OUT / "chaos_long.json").write_text(json.dumps(total, indent=1) + "\n")
    _into_readme(md)
    print(md)
    return 0


def _into_readme(md: str) -> None:
    """The table into the chaos guide, between its ``chaos-long`` markers (left alone without them):
    the guide shows what the last run measured, never an older table beside newer numbers."""
    readme = OUT.parents[1] / "docs" / "guides" / "chaos.md"  # the guide that holds the table
    begin, end = "<!-- chaos-long:begin -->\n", "<!-- chaos-long:end -->"
    text = readme.read_text() if readme.exists() else ""
    if begin in text and end in text.split(begin, 1)[1]:
        head, rest = text.split(begin, 1)
        readme.write_text(head + begin + md + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
