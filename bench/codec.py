#!/usr/bin/env python
"""Case 5: the durable tier's codec, per dtype: compression ratio and speed of raw / plain zstd /
byte planes on a trained model's state.

The reference trainer's TinyGPT (``examples/train_fsdp.py``; fp32 params + AdamW moments =
``--state-mb`` x ``--size`` MB) is trained ``--train-steps`` steps on its synthetic tokens in
this process. Per kind (fp32 weights, bf16 and fp16 weights = the fp32 weights cast, Adam
``exp_avg`` and ``exp_avg_sq``) the tensors are laid end to end and cut into ``--chunk-mib``
chunks, like a shard; every chunk is encoded and decoded (and checked) with ``aegis``'s
``Codec`` in modes raw / zstd / planes at zstd level ``--level`` (the Manager's default, 1), on
one thread. Stored fraction = stored / raw bytes; MB/s of raw bytes (MB = 1e6).

    .venv/bin/python bench/codec.py
    .venv/bin/python bench/codec.py --level 3 --train-steps 50
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402 - bench/ is on sys.path as a script
    MB,
    RESULTS,
    build_gpt,
    f,
    gpt_shape,
    gpt_train_step,
    md_table,
    new_doc,
    plt,
    size_arg,
    text_table,
    trainer_module,
    write_doc,
)

NAME = "codec"
KINDS = ("fp32 weights", "bf16 weights", "fp16 weights", "exp_avg (fp32)", "exp_avg_sq (fp32)")
MODES = ("raw", "zstd", "planes")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mb", type=float, default=48.0, help="MB of params + moments; default 48")
    size_arg(p)
    p.add_argument("--train-steps", type=int, default=20, help="training steps before measuring")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--chunk-mib", type=int, default=16, help="chunk size (MiB), as in a shard")
    p.add_argument("--level", type=int, default=1, help="zstd level (the Manager's default: 1)")
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    return p.parse_args(argv)


def train_state(args: argparse.Namespace, shape: dict[str, int]) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, _ = build_gpt(shape, total_steps=args.train_steps)
    data = trainer_module().SyntheticTokens(shape["vocab_size"], shape["seq_len"], seed=0)
    t0 = time.perf_counter()
    losses = [gpt_train_step(model, opt, data, s, args.batch_size)
              for s in range(args.train_steps)]
    msd, osd = get_state_dict(model, opt)
    names = list(msd)
    weights = [msd[n].detach().float() for n in names]
    moments = osd["state"]
    return {
        "kinds": {
            KINDS[0]: (weights, "float32"),
            KINDS[1]: ([w.to(torch.bfloat16) for w in weights], "bfloat16"),
            KINDS[2]: ([w.to(torch.float16) for w in weights], "float16"),
            KINDS[3]: ([moments[n]["exp_avg"] for n in names if n in moments], "float32"),
            KINDS[4]: ([moments[n]["exp_avg_sq"] for n in names if n in moments], "float32"),
        },
        "losses": losses, "train_s": time.perf_counter() - t0,
    }


def _chunks(tensors: list[Any], chunk: int) -> list[bytes]:
    import torch

    flat = torch.cat([t.detach().reshape(-1).contiguous().view(torch.uint8) for t in tensors])
    raw = flat.numpy().tobytes()
    return [raw[i:i + chunk] for i in range(0, len(raw), chunk)]


def codec_table(kinds: dict[str, tuple[list[Any], str]], chunk_bytes: int, level: int
                ) -> list[dict[str, Any]]:
    from aegis.snapshot.codec import Codec, decode

    rows = []
    for kind, (tensors, dtype) in kinds.items():
        zero_frac = sum(int((t == 0).sum()) for t in tensors) / sum(t.numel() for t in tensors)
        chunks = _chunks(tensors, chunk_bytes)
        raw_total = sum(len(c) for c in chunks)
        for mode in MODES:
            codec = Codec(mode, level, min_gain=0)  # the transform itself, whatever it saves
            stored = 0
            enc_s = dec_s = 0.0
            descs = set()
            for c in chunks:
                t = time.perf_counter()
                blob, desc = codec.encode(c, dtype)
                enc_s += time.perf_counter() - t
                t = time.perf_counter()
                out = decode(blob, desc, len(c))
                dec_s += time.perf_counter() - t
                if out != c:
                    raise RuntimeError(f"codec {mode} did not round-trip a {kind} chunk")
                stored += len(blob)
                descs.add(desc.split(":")[0])
            rows.append({
                "kind": kind, "dtype": dtype, "mode": mode, "chunks": len(chunks),
                "descriptors": sorted(descs), "raw_bytes": raw_total, "stored_bytes": stored,
                "stored_fraction": stored / raw_total, "ratio": raw_total / stored,
                "encode_mbps": raw_total / MB / enc_s if enc_s and mode != "raw" else None,
                "decode_mbps": raw_total / MB / dec_s if dec_s and mode != "raw" else None,
                "zero_fraction": zero_frac,
            })
    return rows


def report(doc: dict[str, Any]) -> str:
    return text_table(
        ["kind", "mode", "raw MB", "stored frac", "ratio", "enc MB/s", "dec MB/s", "zeros"],
        [[r["kind"], r["mode"], f(r["raw_bytes"] / MB, ".1f"), f(r["stored_fraction"], ".3f"),
          f(r["ratio"]), f(r["encode_mbps"], ".0f"), f(r["decode_mbps"], ".0f"),
          f(r["zero_fraction"], ".3f")] for r in doc["rows"]])


def summary_md(doc: dict[str, Any]) -> str:
    rows = []
    for kind in KINDS:
        by = {r["mode"]: r for r in doc["rows"] if r["kind"] == kind}
        if not by:
            continue
        z, p = by["zstd"], by["planes"]
        rows.append([kind, f(z["stored_fraction"], ".3f"), f(p["stored_fraction"], ".3f"),
                     f"{z['encode_mbps']:.0f} / {z['decode_mbps']:.0f}",
                     f"{p['encode_mbps']:.0f} / {p['decode_mbps']:.0f}"])
    return md_table([f"codec (zstd level {doc['args']['level']}, 1 thread)",
                     "zstd: stored / raw", "planes: stored / raw", "zstd MB/s enc / dec",
                     "planes MB/s enc / dec"], rows)


def plot(doc: dict[str, Any], path: Path) -> None:
    pyplot = plt()
    kinds = [k for k in KINDS if any(r["kind"] == k for r in doc["rows"])]
    fig, (a1, a2) = pyplot.subplots(1, 2, figsize=(10, 4.2))
    width = 0.27
    for i, mode in enumerate(MODES):
        rows = [next(r for r in doc["rows"] if r["kind"] == k and r["mode"] == mode)
                for k in kinds]
        xs = [j + (i - 1) * width for j in range(len(kinds))]
        a1.bar(xs, [r["stored_fraction"] for r in rows], width, label=mode)
        if mode != "raw":
            a2.bar([x - width / 2 + (i - 1) * width / 2 for x in range(len(kinds))],
                   [r["encode_mbps"] for r in rows], width / 2, label=f"{mode} encode")
            a2.bar([x + width / 2 + (i - 1) * width / 2 for x in range(len(kinds))],
                   [r["decode_mbps"] for r in rows], width / 2, label=f"{mode} decode",
                   alpha=0.6)
    for ax in (a1, a2):
        ax.set_xticks(range(len(kinds)))
        ax.set_xticklabels(kinds, fontsize=7, rotation=15)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    a1.set_ylabel("stored / raw (lower is better)")
    a2.set_ylabel("MB/s of raw bytes, 1 thread")
    fig.suptitle(f"Durable-tier codec, zstd level {doc['args']['level']}, trained TinyGPT "
                 f"({doc['model']['params'] / 1e6:.1f}M params)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    doc = new_doc(NAME, __file__, argv, args)
    import torch

    torch.set_num_threads(1)
    shape = gpt_shape(args.state_mb * args.size)
    doc["model"] = shape
    print(f"{NAME}: TinyGPT {shape['params'] / 1e6:.1f}M params, training {args.train_steps} "
          "steps ...", flush=True)
    st = train_state(args, shape)
    doc["training"] = {"steps": args.train_steps, "seconds": st["train_s"],
                       "loss_first": st["losses"][0], "loss_last": st["losses"][-1]}
    doc["rows"] = codec_table(st["kinds"], args.chunk_mib << 20, args.level)
    print(report(doc))
    write_doc(doc, args.out)
    plot(doc, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
