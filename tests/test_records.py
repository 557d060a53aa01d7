"""The membership store's round records (``aegis/training/inprocess/records.py``): a whole
member list is stored compressed, a small record as plain JSON, and both read back."""

from __future__ import annotations

import json

import pytest

from aegis.training.inprocess.records import COMPRESS_FROM, decode_record, encode_record

pytestmark = pytest.mark.quick


def test_a_long_member_list_is_stored_compressed_and_read_back() -> None:
    uids = [f"node-{n:05d}/{local}/{100000 + 7919 * (8 * n + local) % 900000}"
            for n in range(256) for local in range(8)]
    record = {"members": uids, "admitted": 3, "by": uids[5]}
    raw = encode_record(record)
    assert raw[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame
    assert len(raw) < len(json.dumps(record)) / 2
    assert decode_record(raw) == record


def test_a_small_record_stays_json_and_old_records_still_read() -> None:
    record = {"base": 4, "removed": ["n1/0/7"], "added": [], "size": 3, "admitted": 0, "by": "n0/0/1"}
    raw = encode_record(record)
    assert len(raw) < COMPRESS_FROM and json.loads(raw) == record
    assert decode_record(json.dumps(record)) == record  # a str, as written before issue 40
    assert decode_record(json.dumps(record).encode()) == record


def test_the_store_watcher_reads_a_compressed_first_round() -> None:
    """``aegis store``'s reading of the membership keys takes the compressed whole list, and a
    change record after it."""
    from datetime import timedelta

    import torch.distributed as dist

    from aegis.cli.store import read_state

    uids = [f"node-{n:04d}/{local}/{4000 + 8 * n + local}" for n in range(128) for local in range(8)]
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
    raw = encode_record({"members": uids, "admitted": 0, "by": uids[0]})
    assert raw[:4] == b"\x28\xb5\x2f\xfd"
    s.set("aegis/round/0/members", raw)
    assert read_state(s)["members"] == uids
    change = {"base": 0, "removed": uids[8:16], "added": [], "size": len(uids) - 8,
              "admitted": 0, "by": uids[0]}
    s.set("aegis/round/1/members", encode_record(change))
    s.set(f"aegis/round/1/list/{uids[0]}", encode_record(uids[:8] + uids[16:]))
    state = read_state(s)  # no base known to the reader: the proposer's whole list
    assert state["round"] == 1 and state["members"] == uids[:8] + uids[16:]
