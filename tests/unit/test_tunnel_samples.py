"""Generator of tunnel-like query names, and the sample files in tests/data/tunnel_samples/.

The generator encodes random bytes the way iodine 0.7 and dns2tcp 0.5 do on the wire
(PLATFORM.md, and the real_*.txt captures beside the samples): data labels of 57-63
characters, names of 190-254 bytes, iodine's handshake (version, login, codec probes,
fragment-size probes of repeated patterns) before the data, dns2tcp's standard base64
with '+' and '/'. The slow channel puts a short encoded label in each query, one every few
seconds. Files: one query a line, ``NAME TYPE``, bytes outside LDH/underscore as ``\\DDD``.

Regenerate with ``EGRESS_REGEN_SAMPLES=1 pytest tests/unit/test_tunnel_samples.py``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from egress.tunnel.labels import unescape_labels

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "tunnel_samples"
ZONE = "t.evil-tunnel.com"  # registered domain evil-tunnel.com, one label of delegation

_B128_HIGH = "".join(chr(c) for c in range(0xBC, 0xFE))
ALPHABETS = {
    "base32": "abcdefghijklmnopqrstuvwxyz012345",  # iodine's, not RFC 4648
    "base64": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-0123456789+",
    "base64u": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-0123456789_",
    "base128": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + _B128_HIGH,
    "dns2tcp": "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/",
    "hex": "0123456789abcdef",
}
IODINE_TYPES = {"NULL": 10, "PRIVATE": 65399, "TXT": 16, "SRV": 33, "MX": 15, "CNAME": 5, "A": 1}
TYPE_NUMBERS = IODINE_TYPES | {"KEY": 25, "AAAA": 28, "HTTPS": 65, "PTR": 12, "NS": 2, "CAA": 257}


def encode(data: bytes, alphabet: str) -> str:
    """Pack ``data`` into symbols of log2(len(alphabet)) bits each."""
    bits = len(alphabet).bit_length() - 1
    value, have, out = 0, 0, []
    for byte in data:
        value, have = (value << 8) | byte, have + 8
        while have >= bits:
            have -= bits
            out.append(alphabet[(value >> have) & ((1 << bits) - 1)])
    if have:
        out.append(alphabet[(value << (bits - have)) & ((1 << bits) - 1)])
    return "".join(out)


def data_name(rng: random.Random, alphabet: str, prefix: str, zone: str = ZONE) -> str:
    """One data query: header + encoded random payload in 57-63 char labels, 190-253 bytes."""
    budget = rng.randint(190, 253) - len(zone) - 1  # data labels and their dots
    text = prefix + encode(rng.randbytes(250), alphabet)
    labels = []
    while budget > 0:
        size = min(rng.randint(57, 63), budget)
        labels.append(text[:size])
        text, budget = text[size:], budget - size - 1
    return ".".join([*labels, zone])


def iodine_handshake(rng: random.Random, encoding: str) -> list[str]:
    b32 = ALPHABETS["base32"]
    names = ["v" + encode(rng.randbytes(6), b32), "l" + encode(rng.randbytes(20), b32)]
    if encoding != "base32":  # case and charset probes only when case survives
        names.append("z" + encode(rng.randbytes(2), b32) + "aAbBcCdDeEfFgGhHiIjJkKlLmMnNoOpPqQ")
    if encoding == "base128":
        names.append("z" + encode(rng.randbytes(2), b32) + "aA0123456789" + _B128_HIGH[:30])
    names += ["s" + encode(rng.randbytes(3), b32), "o" + encode(rng.randbytes(3), b32)]
    for _ in range(8):  # fragment-size probes: a repeated pattern filling the name
        unit = encode(rng.randbytes(5), ALPHABETS[encoding])
        names.append("r" + encode(rng.randbytes(3), b32)[:4] + unit * (240 // len(unit)))
    return [_fit(n) for n in names]


def _fit(text: str) -> str:
    labels = [text[i : i + 62] for i in range(0, len(text), 62)][:4]
    name = ".".join([*labels, ZONE])
    return name if len(name) <= 253 else ".".join([*labels[:3], ZONE])


def iodine(encoding: str, seed: int = 1, data: int = 40, handshake: bool = True) -> list[str]:
    rng = random.Random(f"iodine-{encoding}-{seed}")
    names = iodine_handshake(rng, encoding) if handshake else []
    alphabet = ALPHABETS[encoding]
    for i in range(data):
        names.append(
            data_name(rng, alphabet, "0" + encode(bytes([i, rng.randrange(256)]), alphabet))
        )
    return names


def dns2tcp(seed: int = 1, data: int = 40) -> list[str]:
    rng = random.Random(f"dns2tcp-{seed}")
    b64 = ALPHABETS["dns2tcp"]
    names = [f"AAAAA{encode(rng.randbytes(3), b64)}.=auth.{ZONE}"]
    names.append(f"7x{encode(rng.randbytes(3), b64)}{encode(rng.randbytes(40), b64)}.=auth.{ZONE}")
    names.append(f"7x{encode(rng.randbytes(8), b64)}.=connect.{ZONE}")
    for _ in range(data):
        names.append(data_name(rng, b64, "7xg" + encode(rng.randbytes(5), b64)))
        names.append(f"7xgAAAA{encode(rng.randbytes(2), b64)}.{ZONE}")  # poll for the answer
    return names


def slow(encoding: str, length: int, seed: int = 1, count: int = 400) -> list[str]:
    """Low and slow: a sequence label and ``length`` encoded characters per query."""
    rng = random.Random(f"slow-{encoding}-{length}-{seed}")
    alphabet = ALPHABETS[encoding]
    names = []
    for i in range(count):
        label = encode(rng.randbytes(length), alphabet)[:length]
        names.append(f"{encode(bytes([i & 0xFF]), ALPHABETS['base32'])}.{label}.{ZONE}")
    return names


def escape(name: str) -> str:
    keep = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    return "".join(c if c in keep else f"\\{ord(c):03d}" for c in name)


def read_samples(path: Path) -> list[tuple[str, int]]:
    """``(name, qtype)`` pairs from a sample or corpus file (``NAME [TYPE]`` a line)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        kind = parts[1] if len(parts) > 1 else "A"
        out.append((parts[0], int(kind) if kind.isdigit() else TYPE_NUMBERS[kind]))
    return out


def generated() -> dict[str, list[tuple[str, str]]]:
    files: dict[str, list[tuple[str, str]]] = {}
    for enc in ("base32", "base64", "base64u", "base128"):
        files[f"iodine_{enc}.txt"] = [(n, "A") for n in iodine(enc)]
    files["dns2tcp_txt.txt"] = [(n, "TXT") for n in dns2tcp()]
    files["dns2tcp_key.txt"] = [(n, "KEY") for n in dns2tcp(seed=2)]
    for enc, length in (("base32", 16), ("base32", 8), ("hex", 16), ("hex", 24)):
        files[f"slow_{enc}_{length}.txt"] = [(n, "A") for n in slow(enc, length)]
    return files


def _render(name: str, rows: list[tuple[str, str]]) -> str:
    head = f"# {name}: generated by tests/unit/test_tunnel_samples.py (see its docstring)\n"
    return head + "".join(f"{escape(n)} {t}\n" for n, t in rows)


def test_sample_files_are_current() -> None:
    regen = os.environ.get("EGRESS_REGEN_SAMPLES") == "1"
    for name, rows in generated().items():
        path = SAMPLES / name
        if regen:
            SAMPLES.mkdir(parents=True, exist_ok=True)
            path.write_text(_render(name, rows), encoding="utf-8")
        assert path.read_text(encoding="utf-8") == _render(name, rows), f"regenerate {name}"


@pytest.mark.parametrize("encoding", ["base32", "base64", "base64u", "base128"])
def test_iodine_data_names_have_the_wire_shape(encoding: str) -> None:
    for name in iodine(encoding, handshake=False):
        labels = unescape_labels(name)
        assert 190 <= len(name) <= 254
        assert all(57 <= len(x) <= 63 for x in labels[:-4])  # all but the last data label
        assert len(labels) >= 6


def test_escaped_samples_round_trip() -> None:
    name = iodine("base128", handshake=False)[0]
    assert unescape_labels(escape(name)) == unescape_labels(name)
    assert any(ord(c) > 127 for c in name)


def test_dns2tcp_uses_non_hostname_base64() -> None:
    text = "".join(dns2tcp()[3:10])
    assert "+" in text and "/" in text
