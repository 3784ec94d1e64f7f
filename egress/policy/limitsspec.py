"""``spec.limits``: what a sandbox egress makes may hold at once (:class:`~egress.model.Limits`).

``pids`` is a whole number of tasks (processes and threads); ``memory`` is bytes, written
with a binary unit (``512Mi``, ``2Gi``) or as a plain number. A bare ``2G`` is refused:
it means 10^9 bytes to Kubernetes and 2^30 to systemd and docker, and a limit read the
other way is off by 7%. ``max`` (either key) is no limit. A key left out keeps its default.
"""

from __future__ import annotations

import re

from egress.model import MIN_MEMORY, Limits
from egress.policy.checks import Report, entry, get_map, kind_of, read_values
from egress.policy.tree import Node, Scalar

PATH = "spec.limits"
LIMITS_KEYS = ("pids", "memory")
MIN_PIDS = 16  # bubblewrap, tini, a shell and what it runs
MAX_PIDS = 4_194_304  # the kernel's PID_MAX_LIMIT
MAX_MEMORY = 1 << 50  # 1 PiB: anything larger is a typo, not a limit
NO_LIMIT = "max"  # as cgroup v2's files spell it
_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_SIZE = re.compile(r"([0-9]{1,16})(Ki|Mi|Gi|Ti)?")
_DECIMAL = re.compile(r"([0-9]{1,16})([kKMGT])B?")


def build_limits(node: Node | None, report: Report) -> Limits:
    """The Limits in ``node``; a bad value keeps its default, so one run reports all."""
    if node is None:
        return Limits()
    fields = get_map(node, PATH, report, LIMITS_KEYS)
    explicit = frozenset(key for key in LIMITS_KEYS if entry(fields, key) is not None)
    defaults = {"pids": Limits.pids, "memory": Limits.memory}
    values = read_values(fields, PATH, report, {"pids": _pids, "memory": _memory}, defaults)
    return Limits(pids=values["pids"], memory=values["memory"], explicit=explicit)


def _pids(node: Node) -> int | None:
    value = node.value if isinstance(node, Scalar) else None
    if value == NO_LIMIT:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number of tasks or {NO_LIMIT!r}, got {kind_of(node)}")
    if not MIN_PIDS <= value <= MAX_PIDS:
        raise ValueError(f"must be {MIN_PIDS}-{MAX_PIDS} (or {NO_LIMIT!r}), got {value}")
    return value


def _memory(node: Node) -> int | None:
    value = node.value if isinstance(node, Scalar) else None
    if value == NO_LIMIT:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a size like 512Mi or 2Gi, or {NO_LIMIT!r}, got {kind_of(node)}")
    text = str(value)
    found = _SIZE.fullmatch(text)
    if found is None:
        decimal = _DECIMAL.fullmatch(text)
        if decimal:
            raise ValueError(f"{text!r} is ambiguous (10^n bytes to Kubernetes, 2^n to"
                             f" systemd): write {decimal[1]}{decimal[2].upper()}i, or the"
                             " number of bytes")  # fmt: skip
        raise ValueError(f"expected a size like 512Mi or 2Gi, or {NO_LIMIT!r}, got {text!r}")
    size = int(found.group(1)) * _UNITS[found.group(2) or ""]
    if size < MIN_MEMORY:
        raise ValueError(f"{text} is below the least a workload starts in ({MIN_MEMORY >> 20}Mi)")
    if size > MAX_MEMORY:
        raise ValueError(f"{text} is over 1024Ti; write {NO_LIMIT!r} for no limit")
    return size


def format_size(size: int) -> str:
    """``size`` bytes in the largest binary unit that divides it (for messages, render)."""
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        if size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return str(size)
