"""A freeze intent's slot (store/intents.py) and the violation it carries, as bytes."""

from __future__ import annotations

import pytest

from egress.model import Action, Flow, Violation, ViolationClass
from egress.store import intents

FLOW = Violation(
    cls=ViolationClass.BLOCKED_CONNECT, layer="inline", rule="default deny",
    detail="udp to [2001:db8::9]:53", at=1_700_000_000.25, action=Action.FREEZE,
    flow=Flow("udp", "fd00::2", "2001:db8::9", 41000, 53), uid=1000,
)  # fmt: skip
DNS = Violation(
    cls=ViolationClass.TUNNEL, layer="observer", rule="tunnel: entropy",
    detail="q7x2k.t.example.com TXT scored 0.93", at=1_700_000_001.0, action=Action.FREEZE,
    qname="q7x2k.t.example.com", qtype="TXT",
)  # fmt: skip


@pytest.mark.parametrize("v", [FLOW, DNS])
def test_a_violation_comes_back_from_its_json_whole(v: Violation) -> None:
    assert Violation.from_json(v.to_json()) == v


def test_a_violation_json_with_a_wrong_field_is_refused() -> None:
    bad = {**FLOW.to_json(), "uid": "root"}
    with pytest.raises(TypeError, match="'root'"):
        Violation.from_json(bad)
    with pytest.raises(ValueError):
        Violation.from_json({**FLOW.to_json(), "class": "nosuch"})
    with pytest.raises(KeyError):
        Violation.from_json({k: x for k, x in FLOW.to_json().items() if k != "rule"})


def test_a_slot_is_one_block_and_reads_back() -> None:
    record: dict[str, object] = {"sandbox_id": "sb1", "violation": FLOW.to_json()}
    block = intents.encode(7, record)
    assert block is not None and len(block) == intents.SLOT
    assert intents.decode(block) == (7, record)


def test_what_is_no_whole_record_reads_as_none() -> None:
    block = intents.encode(3, {"sandbox_id": "sb1"})
    assert block is not None
    assert intents.decode(bytes(intents.SLOT)) is None  # never written
    torn = bytearray(block)
    torn[25] ^= 0x01  # a byte of the payload (the head is 20 bytes)
    assert intents.decode(bytes(torn)) is None
    short = block[:30]  # a length that runs past what was read
    assert intents.decode(short) is None
    assert intents.decode(b"XXXX" + block[4:]) is None  # another format's block


def test_a_record_too_big_for_one_slot_is_not_written() -> None:
    assert intents.encode(1, {"detail": "x" * intents.MAX_PAYLOAD}) is None
    fits = "x" * (intents.MAX_PAYLOAD - len('{"detail":""}'))
    assert intents.encode(1, {"detail": fits}) is not None


def test_a_files_records_come_oldest_first_and_skip_the_empty() -> None:
    blocks = [intents.encode(seq, {"n": seq}) for seq in (5, 2, 9)]
    data = bytes(intents.SLOT).join(b for b in blocks if b is not None) + bytes(intents.SLOT)
    assert [seq for seq, _ in intents.records(data)] == [2, 5, 9]
