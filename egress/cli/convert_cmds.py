"""`egressctl import cilium` and `egressctl export cilium` (egress.convert does the work).

Nothing is written unless the whole input converts: every refused construct is reported
(FILE:LINE:COL and why) and the command exits 2. Files are written whole (a temporary
file renamed into place) and an existing one is kept unless --force.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from egress.errors import InputError

FMT = argparse.RawDescriptionHelpFormatter

IMPORT_DESCRIPTION = """\
Convert the egress rules of CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy
documents into egress policies, one per document: toFQDNs (matchName, matchPattern) with
their toPorts become dns.allow rules with those ports; the DNS rule's rules.dns names
may be asked; serverNames and rules.http host become connect.check_names; toCIDR and
toCIDRSet become connect.allow. Where the two languages differ, the conversion is exact
or refused with FILE:LINE:COL and why: a '*' inside a label (api-*.example.com), a bare
'*' toFQDNs pattern, toFQDNs without toPorts (every port), egressDeny, toEndpoints and
other in-cluster destinations, CIDR exceptions, named ports, SCTP, L7 rules beyond the
HTTP host. Cilium ignores the record type; egress asks for one (--types). A DNS rule's
matchPattern '*' lets every name be asked in Cilium; egress answers only the names its
rules allow (the '*' is kept in an annotation, and export gives it back). The endpoint
selector and namespace are kept in metadata.annotations."""

EXPORT_DESCRIPTION = """\
Write an egress policy as one CiliumNetworkPolicy: a DNS rule to kube-dns naming exactly
the names egress answers, a toFQDNs rule per set of ports, serverNames (TLS) or HTTP host
rules (ports 80, 8080) on connect.check_names' ports, a toCIDR rule per static
destination. A comment at the top lists what Cilium will not enforce (record types,
tunnel scoring, rebinding, TTL bounds, the rate limit, freezing). mode: audit is
refused: Cilium's audit mode is per endpoint, not per policy."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    i = sub.add_parser(
        "import", help="convert another tool's policy (cilium) into egress policies",
        formatter_class=FMT, description=IMPORT_DESCRIPTION,
        epilog="examples:\n  egressctl import cilium policies/cilium/fqdn-github.yaml\n"
        "  egressctl import cilium cnp.yaml -o /etc/egress/policies/   # one file each\n\n"
        "exit status: 0 converted, 2 refused or bad input (nothing written).",
    )  # fmt: skip
    i.add_argument("format", choices=["cilium"], help="the other tool's language")
    i.add_argument("file", metavar="FILE", help="YAML with one or more Cilium policies")
    i.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="a file (one policy) or a directory (NAME.yaml each); default stdout",
    )
    i.add_argument("--name", help="metadata.name for the policy (a file holding one)")
    i.add_argument(
        "--types",
        default="A,AAAA,CNAME,HTTPS",
        metavar="T,T",
        help="record types each converted name may be asked for (default"
        " A,AAAA,CNAME,HTTPS: what a connecting client needs)",
    )
    i.add_argument("--force", action="store_true", help="overwrite existing files")
    i.set_defaults(func=cmd_import)
    e = sub.add_parser(
        "export", help="write an egress policy in another tool's language (cilium)",
        formatter_class=FMT, description=EXPORT_DESCRIPTION,
        epilog="examples:\n  egressctl export cilium policies/python-dev.yaml\n"
        "  egressctl export cilium p.yaml --selector app=agent --namespace agents -o cnp.yaml"
        "\n\nexit status: 0 written, 2 refused or bad input (nothing written).",
    )  # fmt: skip
    e.add_argument("format", choices=["cilium"], help="the other tool's language")
    e.add_argument("policy", metavar="POLICY", help="an egress policy file")
    e.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    e.add_argument(
        "--kind",
        choices=["CiliumNetworkPolicy", "CiliumClusterwideNetworkPolicy"],
        default="CiliumNetworkPolicy",
        help="default CiliumNetworkPolicy",
    )
    e.add_argument(
        "--selector",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="endpointSelector matchLabels (repeatable; default: the one import"
        " kept, else every endpoint of the namespace)",
    )
    e.add_argument("--namespace", help="metadata.namespace (CiliumNetworkPolicy only)")
    e.add_argument("--force", action="store_true", help="overwrite an existing -o FILE")
    e.set_defaults(func=cmd_export)


def cmd_import(args: argparse.Namespace) -> int:
    from egress.convert.cilium_read import read
    from egress.policy.rrtypes import type_number

    types = tuple(t.strip().upper() for t in args.types.split(",") if t.strip())
    for t in types:
        try:
            type_number(t)
        except ValueError as exc:
            raise InputError(f"--types: {exc}") from None
    text = _read(args.file)
    converted = read(text, args.file, types, args.name)
    if not args.output:
        sys.stdout.write("---\n".join(c.text for c in converted))
        if len(converted) > 1:
            print(f"{args.file}: {len(converted)} policies; -o DIR writes one file each",
                  file=sys.stderr)  # fmt: skip
        return 0
    out = Path(args.output)
    if len(converted) > 1 or out.is_dir():
        if not out.is_dir():
            raise InputError(f"{out}: {len(converted)} policies need a directory (-o DIR/)")
        targets = [(out / f"{c.name}.yaml", c.text) for c in converted]
    else:
        targets = [(out, converted[0].text)]
    _write_all(targets, args.force)
    for path, _ in targets:
        print(f"{path}: written", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from egress.convert.cilium_write import ExportError, write
    from egress.policy.loader import load_policy

    policy = load_policy(args.policy)
    selector = None
    if args.selector:
        labels = {}
        for item in args.selector:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise InputError(f"--selector {item!r}: expected KEY=VALUE")
            labels[key] = value
        selector = {"matchLabels": labels}
    try:
        text = write(policy, args.kind, selector, args.namespace)
    except ExportError as exc:
        raise InputError(str(exc)) from None
    if args.output:
        _write_all([(Path(args.output), text)], args.force)
        print(f"{args.output}: written", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _read(path: str) -> str:
    from egress.policy.loader import MAX_BYTES

    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    if len(data) > MAX_BYTES:
        raise InputError(f"{path}: larger than 1 MiB; refusing to parse it")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _write_all(targets: list[tuple[Path, str]], force: bool) -> None:
    from egress.store.paths import write_whole

    taken = [str(p) for p, _ in targets if p.exists()]
    if taken and not force:
        raise InputError(f"{', '.join(taken)} exist{'s' if len(taken) == 1 else ''};"
                         " pass --force to replace")  # fmt: skip
    for path, text in targets:
        write_whole(path, text.encode())
