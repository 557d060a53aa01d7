"""The public surface: every name in ``aegis.__all__`` resolves, and what ``save()`` raises
into user code in-process (``Regroup``) or a fenced peer raises (``PeerLost``) is importable
from ``aegis`` itself."""

from __future__ import annotations

import pytest

import aegis

pytestmark = pytest.mark.quick  # unit / single-process: make test-quick


def test_every_public_name_resolves() -> None:
    missing = [n for n in aegis.__all__ if getattr(aegis, n, None) is None]
    assert not missing, missing


def test_round_exceptions_are_public() -> None:
    from aegis.training.inprocess.round import PeerLost, Regroup

    assert aegis.Regroup is Regroup and aegis.PeerLost is PeerLost
    assert {"Regroup", "PeerLost"} <= set(aegis.__all__)
    assert issubclass(aegis.PeerLost, aegis.AegisError)


def test_manager_keywords_are_the_config_fields_with_the_same_defaults() -> None:
    """Every ManagerConfig field is an explicit keyword of Manager (IDEs and type checkers see
    the durable options too), with the same default; staging and chunk_bytes default to None
    there (the config's own default then applies: $AEGIS_STAGING, 16 MiB)."""
    import dataclasses
    import inspect

    params = inspect.signature(aegis.Manager.__init__).parameters
    fields = {f.name: f for f in dataclasses.fields(aegis.ManagerConfig)}
    assert set(fields) == set(params) - {"self", "state"}
    for name, f in fields.items():
        if name in ("job", "staging", "chunk_bytes"):
            continue
        assert params[name].default == f.default, name
    doc = aegis.Manager.__doc__ or ""
    assert all(f"    {name}:" in doc for name in fields), "Manager's Args: block lists every field"
