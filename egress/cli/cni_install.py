"""egress-cni-install: put egress-cni on a node (the DaemonSet's init container).

Three things, each written atomically (a copy beside the target, then a rename), so the
kubelet or the runtime never reads half a file:

1. the plugin, ``egress/cli/cni.py`` (one stdlib-only file), as ``BIN_DIR/egress-cni``;
2. the policies (``*.yaml`` of ``--policies``) into ``--host-policy-dir``, where the
   plugin reads them on the node;
3. the chained entry: the network's conflist (the first ``*.conflist`` or ``*.conf`` in
   ``CONF_DIR`` by name, the one the runtime uses) gets ``{"type": "egress-cni", ...}``
   as its last plugin, replacing an earlier egress-cni entry. A lone ``.conf`` becomes
   a ``.conflist`` of that plugin and ours.

Run it again and the result is the same (idempotent); ``--remove`` takes the entry out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from egress.cli import cni
from egress.store.paths import write_whole

ENTRY_TYPE = "egress-cni"


class InstallError(Exception):
    pass


def install_plugin(bin_dir: Path) -> Path:
    target = bin_dir / "egress-cni"
    write_whole(target, Path(cni.__file__).read_bytes(), 0o755)
    return target


def install_policies(src: Path, dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for path in sorted(src.glob("*.yaml")):
        write_whole(dest / path.name, path.read_bytes(), 0o644)
        names.append(path.stem)
    return names


def primary_conf(conf_dir: Path) -> Path:
    """The network configuration the runtime uses: the first by name (libcni's order)."""
    found = sorted(p for p in conf_dir.iterdir() if p.suffix in (".conflist", ".conf", ".json"))
    found = [p for p in found if not p.name.startswith(".")]
    if not found:
        raise InstallError(f"{conf_dir}: no CNI network configuration yet (is the network "
                           "plugin installed? egress-cni chains after it)")  # fmt: skip
    return found[0]


def chained(conf: dict[str, Any], entry: dict[str, Any] | None) -> dict[str, Any]:
    """``conf`` (a conflist, or one plugin's conf) as a conflist ending in ``entry``
    (without an egress-cni entry when ``entry`` is None)."""
    if "plugins" in conf:
        if not isinstance(conf["plugins"], list):
            raise InstallError("the conflist's plugins is not a list")
        out = dict(conf)
        plugins = [
            p for p in conf["plugins"] if not (isinstance(p, dict) and p.get("type") == ENTRY_TYPE)
        ]
    else:
        single = {k: v for k, v in conf.items() if k not in ("cniVersion", "name")}
        out = {"cniVersion": conf.get("cniVersion", "1.0.0"), "name": conf.get("name", "")}
        plugins = [single]
    out["plugins"] = plugins + ([entry] if entry is not None else [])
    return out


def chain(conf_dir: Path, entry: dict[str, Any] | None) -> Path:
    """Add (or with ``entry`` None, remove) the egress-cni entry; returns the file."""
    path = primary_conf(conf_dir)
    try:
        conf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InstallError(f"{path}: not a CNI configuration: {exc}") from None
    if not isinstance(conf, dict):
        raise InstallError(f"{path}: not a JSON object")
    out = chained(conf, entry)
    target = path if path.suffix == ".conflist" else path.with_suffix(".conflist")
    write_whole(target, (json.dumps(out, indent=2) + "\n").encode())
    if target != path:
        path.unlink()  # the lone .conf is the conflist now
    return target


def entry_for(args: argparse.Namespace) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": ENTRY_TYPE, "policyDir": str(args.host_policy_dir),
                             "socket": args.socket,
                             # the pod's annotations, for mapping entries that match them
                             "capabilities": {cni.ANNOTATIONS_CAPABILITY: True}}  # fmt: skip
    if args.default_policy:
        entry["policy"] = args.default_policy
    if args.unmatched:
        entry["unmatched"] = args.unmatched
    if args.mapping:
        try:
            mapping = yaml.safe_load(Path(args.mapping).read_text()) or []
        except (OSError, yaml.YAMLError) as exc:
            raise InstallError(f"--mapping {args.mapping}: {exc}") from None
        if not isinstance(mapping, list):
            raise InstallError(f"--mapping {args.mapping}: a list of {{namespace, pod, policy}}")
        entry["mapping"] = mapping
    if not entry.get("policy") and not entry.get("mapping") and args.unmatched != "pass":
        raise InstallError("give --default-policy, --mapping, or both")
    return entry


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="egress-cni-install", description=__doc__.split("\n\n")[0])
    p.add_argument("--cni-bin-dir", type=Path, default=Path("/opt/cni/bin"))
    p.add_argument("--cni-conf-dir", type=Path, default=Path("/etc/cni/net.d"))
    p.add_argument("--policies", type=Path, help="directory of NAME.yaml policies to install")
    p.add_argument(
        "--host-policy-dir",
        type=Path,
        default=Path(cni.DEFAULT_POLICY_DIR),
        help="where they go on the node, for the plugin (default: %(default)s)",
    )
    p.add_argument("--default-policy", metavar="NAME", help="for pods no mapping entry matches")
    p.add_argument(
        "--mapping",
        metavar="FILE",
        help="YAML list of {namespace, pod, policy} (globs), first match wins",
    )
    p.add_argument(
        "--unmatched",
        choices=["refuse", "pass"],
        help="a pod no mapping entry matches and no --default-policy covers: its start "
        "fails (refuse, the plugin's default), or it runs without egress (pass)",
    )
    p.add_argument("--socket", default=cni.DEFAULT_SOCKET, help="egressd's socket on the node")
    p.add_argument("--remove", action="store_true", help="take the egress-cni entry out")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        if args.remove:
            print(f"egress-cni-install: removed from {chain(args.cni_conf_dir, None)}")
            return
        entry = entry_for(args)
        primary_conf(args.cni_conf_dir)  # no network yet: write nothing
        args.cni_bin_dir.mkdir(parents=True, exist_ok=True)
        target = install_plugin(args.cni_bin_dir)
        names = install_policies(args.policies, args.host_policy_dir) if args.policies else []
        conf = chain(args.cni_conf_dir, entry)
    except (InstallError, OSError) as exc:
        print(f"egress-cni-install: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"egress-cni-install: {target}; policies {', '.join(names) or '(none)'} in "
          f"{args.host_policy_dir}; chained in {conf}")  # fmt: skip


if __name__ == "__main__":
    main()
