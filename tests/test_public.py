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
