"""Per-query features of egress.tunnel: names, normalised entropy, randomness, score."""

from __future__ import annotations

import functools
import io
import itertools
import json
import math
import random
import re
import statistics
import string
from collections import Counter

import pytest
from publicsuffixlist import PublicSuffixList
from test_tunnel_samples import ALPHABETS, dns2tcp, escape, iodine

from egress.tunnel import labels, score_name
from egress.tunnel.entropy import (
    COMMON_BIGRAMS,
    alphabet_size,
    entropy_bits,
    expected_entropy,
    folded_alphabet,
    label_stats,
    normalised_entropy,
    randomness,
    word_likeness,
)
from egress.tunnel.features import name_features
from egress.tunnel.labels import name_from_labels, split_name, unescape_labels

WORDS = [
    "pythonhosted", "githubusercontent", "pkg-containers", "release-assets", "production",
    "cloudresourcemanager", "microsoftonline", "bedrock-runtime", "management", "kubernetes",
    "objects-origin", "dualstack", "registry", "artifactregistry", "securetoken",
]  # fmt: skip


def rand(alphabet: str, n: int, rng: random.Random) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


# --- names -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "zone", "sub"),
    [
        ("files.pythonhosted.org", "pythonhosted.org", "files"),
        ("bucket.s3.amazonaws.com", "bucket.s3.amazonaws.com", ""),  # PSL private section
        ("my-alb-1234.us-east-1.elb.amazonaws.com", "my-alb-1234.us-east-1.elb.amazonaws.com", ""),
        ("a.b.t.evil-tunnel.com.", "evil-tunnel.com", "a.b.t"),
        ("X.Tunnel.Example.COM", "example.com", "X.Tunnel"),
        ("kubernetes.default.svc.cluster.local", "cluster.local", "kubernetes.default.svc"),
        ("s3.amazonaws.com", "s3.amazonaws.com", ""),  # a public suffix itself
        ("", "", ""),
    ],
)  # fmt: skip
def test_split_name_uses_the_public_suffix_list(name: str, zone: str, sub: str) -> None:
    split = split_name(name)
    assert (split.zone, split.subdomain) == (zone, sub)


def test_registered_domain_answers_as_the_library_does() -> None:
    # The walk from the right stops at the first suffix no rule ends in; the library tries
    # every depth. Names made from every rule (exceptions, wildcards, deep private rules),
    # with and without labels to the left, and mixtures of rule labels, must agree.
    psl = labels._psl()
    assert labels._reach() is not None  # the fast path is in use, not the fallback
    rules = sorted(psl._publicsuffix)
    rng = random.Random(4)
    names = []
    for rule in rules:
        for left in ("", "x.", "a.b.", "www."):
            names.append(left + rule.lstrip("!").replace("*.", ""))
            names.append(left + rule.lstrip("!").replace("*", "q"))
    words = ["com", "ck", "jp", "kobe", "city", "zz", "amazonaws", "s3", "www", "uk", "co"]
    for _ in range(20_000):
        names.append(".".join(rng.choice(words) for _ in range(rng.randint(1, 6))))
    for name in names:
        lowered = name.split(".")
        assert labels.registered_domain(lowered) == (psl.privatesuffix(name) or name), name


def test_registered_domain_holds_for_rules_the_list_may_add(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rule may begin with any label ("x.se" does today): the walk's probe must not match.
    rules = "com\nx.shop.example.com\n*.w.example.com\n!a.w.example.com\nx\n"
    psl = PublicSuffixList(source=io.StringIO(rules))
    monkeypatch.setattr(labels, "_psl", lambda: psl)
    monkeypatch.setattr(labels, "_reach", functools.cache(labels._reach.__wrapped__))
    monkeypatch.setattr(
        labels, "_public_labels", functools.cache(labels._public_labels.__wrapped__)
    )
    for name in ["shop.example.com", "x.shop.example.com", "y.x.shop.example.com",
                 "w.example.com", "b.w.example.com", "c.b.w.example.com", "a.w.example.com",
                 "z.a.w.example.com", "x", "y.x", "example.com", "com"]:  # fmt: skip
        assert labels.registered_domain(name.split(".")) == (psl.privatesuffix(name) or name), name


def test_wire_labels_round_trip_through_presentation_form() -> None:
    labels = (b"a\xe4.b+", b"t", b"evil-tunnel", b"com")
    name = name_from_labels(labels)
    assert name == "a\\228\\046b\\043.t.evil-tunnel.com"
    assert [x.encode("latin-1") for x in unescape_labels(name)] == list(labels)


def test_presentation_escapes_decode_to_bytes() -> None:
    assert unescape_labels(r"a\228b.c\.d.example.com") == ["a\xe4b", "c.d", "example", "com"]
    assert split_name(r"a\.b.x.example.com").labels == ("a.b", "x")
    assert split_name(r"a\.b.x.example.com").sub_len == 5


@pytest.mark.parametrize(
    ("name", "labels"),
    [
        (r"b.a\\.", ["b", "a\\"]),  # an escaped backslash, then the root
        (r"a\\\.b", ["a\\.b"]),  # an escaped backslash, then an escaped dot
        (r"ab\.", ["ab."]),  # the last dot escaped: not the root
        (r"a\12.b", ["a12", "b"]),  # two digits are not a byte: the escape takes one
        ("a\\", ["a\\"]),  # a lone backslash at the end stays as it is
        (r"x\999.y.", ["x\xe7", "y"]),  # 999 & 0xff
        ("a..", ["a", ""]),
        (".", []),
    ],
)  # fmt: skip
def test_escapes_and_separators(name: str, labels: list[str]) -> None:
    assert unescape_labels(name) == labels


def _reference_unescape(label: str) -> str:
    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        return chr(int(code) & 0xFF) if len(code) == 3 else code or "\\"

    return re.sub(r"\\([0-9]{3}|.|$)", one, label, flags=re.S)


def test_escapes_decode_as_a_reference_decoder_does() -> None:
    rng = random.Random(11)
    for _ in range(100_000):
        label = "".join(rng.choice("\\\\\\0123456789aZ\n\xe4") for _ in range(rng.randrange(16)))
        assert labels._unescape(label) == _reference_unescape(label), label


# --- entropy ------------------------------------------------------------------------------


def test_expected_entropy_approaches_log2_k_for_long_strings() -> None:
    assert expected_entropy(1, 16) == 0.0
    # Miller-Madow: E[H] ~ log2 k - (k - 1) / (2 n ln 2) once n >> k
    for n, k in ((255, 16), (200, 10)):
        approx = math.log2(k) - (k - 1) / (2 * n * math.log(2))
        assert expected_entropy(n, k) == pytest.approx(approx, abs=0.02)
    # n << k: nearly all symbols distinct, so about log2 n
    assert expected_entropy(8, 256) == pytest.approx(3.0, abs=0.1)


def test_raw_entropy_is_capped_by_alphabet_and_length_but_normalised_is_not() -> None:
    rng = random.Random(7)
    hex16 = [rand(ALPHABETS["hex"], 16, rng) for _ in range(200)]
    b64_63 = [rand(ALPHABETS["base64"], 63, rng) for _ in range(200)]
    assert max(entropy_bits(s) for s in hex16) <= 4.0  # log2(16): the cap
    assert statistics.mean(entropy_bits(s) for s in b64_63) > 5.0
    for sample in (hex16, b64_63):
        mean = statistics.mean(normalised_entropy(s) for s in sample)
        assert mean == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("encoding", ["hex", "base32", "base64", "base128"])
@pytest.mark.parametrize("n", [16, 32, 63])
def test_random_encoded_labels_normalise_near_one(encoding: str, n: int) -> None:
    rng = random.Random(n)
    values = [normalised_entropy(rand(ALPHABETS[encoding], n, rng)) for _ in range(200)]
    assert 0.95 <= statistics.median(values) <= 1.05


def test_repetitive_text_and_english_words_differ_from_random() -> None:
    assert normalised_entropy("aeaqcaib" * 7) < 0.7  # iodine's fragment-size probe
    rng = random.Random(3)
    b32 = [randomness(rand(ALPHABETS["base32"], 32, rng))[0] for _ in range(200)]
    assert statistics.median(b32) > 0.9
    # Entropy alone cannot tell words from random at DNS lengths; word-likeness can.
    assert statistics.mean(normalised_entropy(w) for w in WORDS) > 0.9
    assert max(randomness(w)[0] for w in WORDS) == 0.0
    assert min(word_likeness(w) for w in WORDS) > 0.6


def test_label_statistics_match_their_definitions() -> None:
    # One loop computes them all; each against the plain definition, over text with
    # both cases, digits, hostname punctuation, other ASCII, latin-1 and wider characters.
    rng = random.Random(5)
    pool = string.ascii_letters + string.digits + "-_+/=.\\ \xe4\xff\u0130\u212a"
    for _ in range(20_000):
        chars = rng.sample(pool, rng.randrange(1, 12))  # a few classes at a time, or many
        text = "".join(rng.choice(chars) for _ in range(rng.randrange(300)))
        stats = label_stats(text)
        n = len(text)
        bits = -sum(c / n * math.log2(c / n) for c in Counter(text).values()) if n > 1 else 0.0
        assert stats.bits == pytest.approx(bits, abs=1e-9)
        assert stats.flips == len(re.findall(r"(?=[a-z][A-Z]|[A-Z][a-z])", text))
        pairs = [
            (x + y).lower() for x, y in itertools.pairwise(text)
            if re.fullmatch(r"[A-Za-z]{2}", x + y)
        ]  # fmt: skip
        assert stats.pairs == len(pairs)
        assert stats.common == sum(pair in COMMON_BIGRAMS for pair in pairs)
        assert stats.other == len(re.findall(r"[^A-Za-z0-9_-]", text))
        if max(text, default="a") <= "\xff":
            assert folded_alphabet(stats.classes) == alphabet_size(text.lower())
    assert label_stats("") == (0.0, 0, 0, 0, 0, 0)


def test_short_labels_carry_no_randomness() -> None:
    assert randomness("x7q9z2")[0] == 0.0
    assert randomness("c9akciq32xyz")[0] < randomness("c9akciq32xyzt0p4v7wq")[0]


@pytest.mark.parametrize(
    ("text", "k"),
    [("0123", 10), ("deadbeef01", 16), ("face", 26), ("abc123xyz", 36), ("aBcD", 64),
     ("ab+/", 64), ("a\xe4b", 128), ("my-alb-123", 36), ("dead-beef_01", 16), ("a-b", 26),
     ("1-2", 10), ("---", 26), ("", 26), ("A-b", 64), ("a b", 64), ("A_B", 26)],
)  # fmt: skip
def test_alphabet_size(text: str, k: int) -> None:
    assert alphabet_size(text) == k


@pytest.mark.parametrize(
    "label",
    ["Zm9vYmFyYmF6cXV4cXV1eA", "zm9vymfyymf6cxv4cxv1ea", "c9akciq32xyzt0p4v7wq",
     "MFRGGZDFMZTWQ2LKNNWG23TP", "a\xe4bc\xf6d\xfcef", "pythonhosted", "x7q9"],
)  # fmt: skip
def test_features_judge_each_label_as_sent_and_spell_it_folded(label: str) -> None:
    # The score sees the label as sent (both cases: a base64 alphabet); the whole-name
    # price spells it case-folded, as it keys it.
    f = name_features(f"{label}.t.example.com")
    r, _ = randomness(label)
    assert f.randomness == pytest.approx(r * min(1.0, len(label) / 24))
    assert f.part_alphabet == (alphabet_size(label.lower()), 26)


# --- score_name ---------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["base32", "base64", "base64u", "base128"])
def test_iodine_data_names_are_tunnel_shaped(encoding: str) -> None:
    for name in iodine(encoding, handshake=False, data=10):
        ns = score_name(name, 1)
        assert ns.sub_len >= 160 and ns.max_label >= 57
        assert ns.score >= 4.0, ns.describe()
        assert ns.info_bytes > 60


def test_dns2tcp_names_carry_non_hostname_bytes() -> None:
    ns = score_name(dns2tcp()[3], 16)  # the first data query
    assert ns.non_hostname > 0 and ns.case_flips >= 4 and ns.data_type == "TXT"
    assert ns.score >= 6.0


def test_data_only_types_add_points() -> None:
    name = "x7q9z2.t.evil-tunnel.com"
    assert score_name(name, 1).score == 0.0
    assert score_name(name, 10).score == 1.5  # NULL
    assert score_name(name, 65399).data_type == "PRIVATE(65399)"
    assert score_name(name, 16).score == 0.5  # TXT: real tools use it too
    assert score_name("evil-tunnel.com", 10).score == 0.0  # no subdomain, nothing to carry


def test_benign_lookalikes_stay_well_below_the_shaped_score() -> None:
    for name in (
        "my-statefulset-0.my-headless-service.default.svc.cluster.local",
        "E52E4A081994729CCFA031770D50970C.gr7.us-east-1.eks.amazonaws.com",
        "e28fac1d4c7d81baead9ba2494ced8b3.safeframe.googlesyndication.com",
        "vpce-0921ebae797a61240-nq0mlb3m.s3.us-east-1.vpce.amazonaws.com",
        "search-my-domain-6pqpt0rfxmqnxa4xqobmsc6jq5.us-east-1.es.amazonaws.com",
    ):
        assert score_name(name, 1).score <= 2.0, score_name(name).describe()


def test_escaped_and_raw_names_score_alike() -> None:
    raw = iodine("base128", handshake=False, data=1)[0]
    a, b = score_name(raw, 10), score_name(escape(raw), 10)
    assert (a.sub_len, a.non_hostname, a.score) == (b.sub_len, b.non_hostname, b.score)


def test_name_score_reports_features_for_people() -> None:
    ns = score_name(iodine("base64", handshake=False, data=1)[0], 10)
    data = ns.to_json()
    json.dumps(data)
    assert {"entropy", "norm_entropy", "hex_run", "b32_run", "b64_run", "reasons"} <= set(data)
    assert ns.b64_run >= 57 and 0.9 < ns.norm_entropy < 1.1
    assert "data-only type NULL +1.50" in ns.reasons
    assert ns.describe().startswith(ns.name)


def test_bytes_outside_hostname_characters_alone_make_a_name_suspicious() -> None:
    # iodine's first upstream-codec probe: a short name, but raw bytes and mixed case
    ns = score_name("zie0aA-Aaahhh-Drink-mal-ein-J\\228germeister-.t.evil-tunnel.com", 1)
    assert ns.non_hostname == 1
    assert "1 non-hostname bytes +3.00" in ns.reasons
    assert ns.score >= 3.0
