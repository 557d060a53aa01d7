"""Manager configuration: a frozen, keyword-only dataclass validated up front."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from aegis.errors import ConfigError
from aegis.snapshot.dcp_io import DEFAULT_CHUNK_BYTES
from aegis.snapshot.node_store import check_job_name, default_store_root

__all__ = ["ManagerConfig"]


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Everything a :class:`~aegis.Manager` needs besides the state.

    Attributes:
        job: names the run; snapshots live under ``<store_dir>/<job>/``.
        every: snapshot every ``every`` steps (``save(step)`` is a no-op otherwise), or ``"auto"``:
            Daly's optimum interval for the measured blocking time per snapshot and ``mtbf_s``, in
            measured steps, within ``[1, every_max]``, adapted as the measurements change (each
            change is an ``interval`` event; see :class:`aegis.goodput.AutoInterval`).
        mtbf_s: with ``every="auto"``: mean seconds between interruptions of the whole job (a node's
            MTBF divided by the number of nodes).
        every_max: with ``every="auto"``: the longest interval, in steps.
        keep: committed snapshots kept in memory per node (plus one in flight).
        replicas: copies of each shard pushed to other nodes (ring placement, other failure domains
            first); 1 survives any single node loss. Capped at (nodes - 1).
        redundancy: ``"replica"`` (whole copies, ``replicas`` of them), ``"dp"``: the same
            replicas, each built on its holder from the holder's own data-parallel copy of the
            same tensors (HSDP's replicate dimension across nodes, plain DP) so that only the
            source's unshared part travels (RNG, per-rank entries, its index); ``"xor"``: XOR parity over
            groups of ``group_size`` nodes (one rank per node per group, failure domains spread),
            surviving one lost node per group at 1 + 1/(group_size - 1) of the state in memory
            instead of 2x, or ``"rs"``: Reed-Solomon parity (pyeclib), surviving ``parity`` lost
            nodes per group at 1 + parity/(group_size - parity) (4+2: 1.5x instead of 3x);
            ``replicas`` is then unused.
        group_size: with ``redundancy="xor"`` or ``"rs"``: nodes per parity group (>= 2; groups of
            group_size to 2 * group_size - 1 members are formed when the nodes do not divide evenly).
        parity: with ``redundancy="rs"``: lost nodes per group it rebuilds (>= 1; group_size must
            be at least parity + 2).
        staging: how ``save()`` copies the state into host memory (:mod:`aegis.snapshot.staging`):
            ``"sync"`` (default: every copy done before ``save()`` returns; device tensors into
            pageable memory), ``"pinned"`` (own slots registered as pinned memory once per process,
            in the background; device copies ``non_blocking`` on a side stream, waited for), or
            ``"async"`` (like pinned, but the tensors the optimizers update are copied after
            ``save()`` returns; the next ``optimizer.step()``, ``save()``, ``restore()`` and
            ``close()`` wait for the copies). ``$AEGIS_STAGING`` sets the default. ``pinned`` and
            ``async`` are opt-in until a GPU run has verified them (docs/architecture.md 3.1).
        store_dir: node store root (a tmpfs); default ``$AEGIS_STORE_DIR`` or ``/dev/shm/aegis``.
        timeout: bound on every snapshot collective; a peer silent for longer is declared gone.
        chunk_bytes: checksum/compression unit of a shard.
        events_dir: where each rank appends its JSON-lines events; default
            ``$AEGIS_EVENTS_DIR`` or ``<store_dir>/<job>/events``.
        rng: snapshot the python, numpy, torch (and CUDA) RNG states of every rank.
        verbose: print one human line per snapshot and restore on rank 0.
        debug: check at every snapshot that entries declared :func:`~aegis.replicated` are equal on
            every rank (one all-gather of a digest per snapshot).
        fresh: start this job over: remove its snapshots from the node stores when the Manager
            starts (refused while the durable tier holds committed steps of the job). Without it, a
            first ``save()`` without ``restore()`` while committed snapshots of the job exist is an
            error, since the next restore would go back to them.
        durable: object-store URL of the durable tier (``file:///path`` or ``s3://bucket/prefix``);
            None disables it. Checked (bucket, credentials, write access) when the Manager starts.
        durable_every: upload the committed snapshot every N steps ...
        durable_every_s: ... or when this many seconds passed since the last upload began
            (whichever comes first).
        durable_keep_last: retention: the last N committed durable steps ...
        durable_keep_every: ... and every K-th step (0: none); the newest committed step is never
            deleted.
        durable_codec: ``planes`` (zstd + byte planes for floats), ``zstd`` or ``raw``.
        durable_level: the zstd level (1 by default: on byte planes of a trained model's bf16 weights it
            stored 0.68 of raw against level 3's 0.71, encoding 1.6x as fast: ``bench/codec.py
            --level 1`` vs ``--level 3``).
        durable_min_gain: a chunk is stored compressed only when that saves at least this share
            of its bytes, else raw (0.25: a trained model's fp32 state, 0.80-0.84 of raw in
            planes, is stored raw, since decoding it costs more restore time than the fewer
            bytes save; bf16 weights, 0.68, stay compressed; 0 compresses whatever shrinks).
        durable_max_pending: uploads queued behind the running one before further ones are skipped
            (with a warning event) instead of buffering snapshots without bound.
    """

    job: str
    every: int | str = 1
    mtbf_s: float | None = None
    every_max: int = 1000
    keep: int = 1
    replicas: int = 1
    redundancy: str = "replica"
    group_size: int = 5
    parity: int = 2
    staging: str = field(default_factory=lambda: os.environ.get("AEGIS_STAGING", "sync"))
    store_dir: str | os.PathLike[str] | None = None
    timeout: timedelta = timedelta(minutes=5)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    events_dir: str | os.PathLike[str] | None = None
    rng: bool = True
    verbose: bool = True
    debug: bool = False
    fresh: bool = False
    durable: str | None = None
    durable_every: int = 10
    durable_every_s: float | None = None
    durable_keep_last: int = 2
    durable_keep_every: int = 0
    durable_codec: str = "planes"
    durable_level: int = 1
    durable_min_gain: float = 0.25
    durable_max_pending: int = 2

    def __post_init__(self) -> None:
        check_job_name(self.job)
        if self.every == "auto":
            m = self.mtbf_s
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < float("inf"):
                raise ConfigError(
                    f"every='auto' needs mtbf_s=<mean seconds between interruptions of the whole job> "
                    f"> 0 (a node's MTBF / the number of nodes), got mtbf_s={m!r}"
                )
        elif isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(
                f"every={self.every!r}: must be an integer >= 1 (snapshot every N steps) or 'auto'"
            )
        elif self.mtbf_s is not None:
            raise ConfigError(f"mtbf_s={self.mtbf_s!r}: only used with every='auto'; drop it or "
                              "pass every='auto'")
        if isinstance(self.every_max, bool) or not isinstance(self.every_max, int) or self.every_max < 1:
            raise ConfigError(f"every_max={self.every_max!r}: must be an integer >= 1 (steps)")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(
                f"keep={self.keep!r}: must be an integer >= 1 (the newest committed snapshot is "
                "always kept)"
            )
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise ConfigError(
                f"replicas={self.replicas!r}: must be an integer >= 0 (copies on other nodes)"
            )
        if self.redundancy not in ("replica", "dp", "xor", "rs"):
            raise ConfigError(f"redundancy={self.redundancy!r}: use 'replica' (whole copies), "
                              "'dp' (whole copies built from data-parallel replicas), "
                              "'xor' (XOR parity groups) or 'rs' (Reed-Solomon parity groups)")
        if self.redundancy == "dp" and self.replicas < 1:
            raise ConfigError("redundancy='dp' keeps replicas (built on their holders from the "
                              "data-parallel copies they hold): set replicas >= 1")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
            raise ConfigError(f"group_size={self.group_size!r}: must be an integer >= 2 (nodes per "
                              "parity group)")
        if isinstance(self.parity, bool) or not isinstance(self.parity, int) or self.parity < 1:
            raise ConfigError(f"parity={self.parity!r}: must be an integer >= 1 (lost nodes per "
                              "group that Reed-Solomon parity rebuilds)")
        if self.redundancy == "rs" and self.group_size < self.parity + 2:
            raise ConfigError(f"group_size={self.group_size} with parity={self.parity}: a "
                              f"Reed-Solomon group needs at least parity + 2 = {self.parity + 2} "
                              "nodes (2 data pieces per stripe); raise group_size or lower parity")
        if self.staging not in ("sync", "pinned", "async"):
            raise ConfigError(f"staging={self.staging!r}: use 'sync' (copy before save() returns), "
                              "'pinned' (pinned host memory, copies waited for) or 'async' (save() "
                              "returns once the copies are issued); $AEGIS_STAGING sets the default")
        if not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0:
            raise ConfigError(f"timeout={self.timeout!r}: must be a positive datetime.timedelta")
        if (
            isinstance(self.chunk_bytes, bool)
            or not isinstance(self.chunk_bytes, int)
            or self.chunk_bytes < 4096
            or self.chunk_bytes % 64
        ):
            raise ConfigError(
                f"chunk_bytes={self.chunk_bytes!r}: must be an integer >= 4096 and a multiple of 64"
            )

        for name in ("rng", "verbose", "debug", "fresh"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be True or False")
        if self.durable is not None and not isinstance(self.durable, str):
            raise ConfigError(f"durable={self.durable!r}: an object-store URL string or None")
        for name in ("durable_every", "durable_keep_last", "durable_max_pending"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: must be an integer >= 1")
        if isinstance(self.durable_keep_every, bool) or not isinstance(self.durable_keep_every, int) \
                or self.durable_keep_every < 0:
            raise ConfigError(f"durable_keep_every={self.durable_keep_every!r}: an integer >= 0")
        if self.durable_every_s is not None and not self.durable_every_s > 0:
            raise ConfigError(f"durable_every_s={self.durable_every_s!r}: seconds > 0, or None")
        if self.durable_codec not in ("planes", "zstd", "raw"):
            raise ConfigError(f"durable_codec={self.durable_codec!r}: use planes, zstd or raw")
        if isinstance(self.durable_min_gain, bool) or not isinstance(self.durable_min_gain, (int, float)) \
                or not 0.0 <= self.durable_min_gain < 1.0:
            raise ConfigError(f"durable_min_gain={self.durable_min_gain!r}: a share of the chunk's "
                              "bytes in [0, 1), e.g. 0.25 (0 compresses whatever shrinks)")

    @property
    def store_root(self) -> Path:
        return Path(self.store_dir) if self.store_dir is not None else default_store_root()

    @property
    def events_root(self) -> Path:
        if self.events_dir is not None:
            return Path(self.events_dir)
        env = os.environ.get("AEGIS_EVENTS_DIR")
        return Path(env) if env else self.store_root / self.job / "events"
