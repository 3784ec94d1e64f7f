"""Where egress keeps runtime state, and where it finds its nft templates."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import egress
from egress.errors import EgressError

DEFAULT_RUN_DIR = "/run/egress"
DEFAULT_STATE_DIR = "/var/lib/egress"
DEFAULT_WORKLOADS_DIR = "/var/lib/egress/workloads"


def run_dir() -> Path:
    """Volatile state (claims, egressd's records): EGRESS_RUN_DIR, default /run/egress."""
    return Path(os.environ.get("EGRESS_RUN_DIR", DEFAULT_RUN_DIR))


def workloads_dir() -> Path:
    """Per-sandbox workload files (private $HOME, mount points): EGRESS_WORKLOADS_DIR,
    default /var/lib/egress/workloads. On disk, not under /run: a $HOME holds caches
    (pip, npm) that must not fill the host's /run tmpfs."""
    return Path(os.environ.get("EGRESS_WORKLOADS_DIR", DEFAULT_WORKLOADS_DIR))


def default_state_dir() -> Path:
    """Durable state (the journal): $EGRESS_STATE_DIR, else /var/lib/egress."""
    return Path(os.environ.get("EGRESS_STATE_DIR") or DEFAULT_STATE_DIR)


def state_dir(option: str | Path | None = None) -> Path:
    """``--state-dir`` if given, else $EGRESS_STATE_DIR, else /var/lib/egress."""
    return Path(option) if option else default_state_dir()


def template_dir() -> Path:
    """nft-templates/: $EGRESS_TEMPLATES, the source tree, or the installed data files."""
    candidates = [
        os.environ.get("EGRESS_TEMPLATES", ""),
        str(Path(egress.__file__).resolve().parent.parent / "nft-templates"),
        str(Path(sys.prefix) / "share" / "egress" / "nft-templates"),
    ]
    for cand in candidates:
        if cand and (Path(cand) / "sandbox.nft").is_file():
            return Path(cand)
    raise EgressError("nft-templates/ not found; set EGRESS_TEMPLATES to its directory")


def read_template(name: str) -> str:
    path = template_dir() / name
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EgressError(f"{path}: cannot read template: {exc.strerror}") from None
