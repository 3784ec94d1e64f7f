"""The lab: a self-contained fake internet for tests, benchmarks and the demo.

Invariant 8 says tests never send a packet off the machine, yet egress must be tested
against real DNS, real TCP and real tunnels. The lab is that world, in two network
namespaces that no route leads out of::

      (sandbox netns, made later by `egressctl run --uplink-netns NAME-up`)
             │ veth; egress masquerades out of NAME-up's default route
   ┌─────────┴──────────────────────────┐        ┌──────────────────────────────────────┐
   │ NAME-up   "uplink"                 │        │ NAME-inet   "the internet"           │
   │ lo                                 │        │ lo   127.0.0.1 (relay targets here)  │
   │                                    │        │      and the server addresses below  │
   │ inet0  198.18.0.1/30               │ veth   │ up0  198.18.0.2/30                   │
   │        2001:db8:ffff::1/64   ──────┼────────┼──    2001:db8:ffff::2/64             │
   │ default via 198.18.0.2 / ::2       │        │ routes: the link only, no default    │
   │ forwarding off (egress's call)     │        │ forwarding off                       │
   └────────────────────────────────────┘        │  DNS   198.51.100.53, 2001:db8:53::53│
                                                 │  HTTP  203.0.113.10-14,              │
                                                 │        198.51.100.10-12,             │
                                                 │        2001:db8:80::10-12            │
                                                 │        ports 80 443 8080, UDP echo   │
                                                 │        9999, ICMP echo (kernel)      │
                                                 │        443 also TLS (the lab's CA)   │
                                                 │  sites pypi/npm/git.lab.test         │
                                                 └──────────────────────────────────────┘

All addresses are documentation or benchmark ranges (RFC 5737, 3849, 2544) and names are
under .test (RFC 2606); nothing is ever added to the host namespace. The DNS server
(dns.py) is authoritative for the zones in a YAML file (zones.py; default
zones.yaml: lab.test and evil.test, with CNAMEs, rebinding answers, a >512-byte answer, a
slow one, a wildcard) and relays tunnel zones (t.lab.test, d.lab.test) as raw bytes to
iodined/dns2tcpd started inside NAME-inet. It logs every packet it receives, first, to a
JSON-lines query log: that log is how tests prove a denied name never reached "upstream".

The web server (web.py) also answers, by Host name, for the sites real tools fetch from
(sites.py, built at ``up``: a PEP 503 index at pypi.lab.test, an npm registry at
npm.lab.test, a git repository at git.lab.test), over plain HTTP and, on 443, TLS with a
certificate from a CA made for the lab (``lab.ca_file``). It logs every request to an
access log (accesslog.py), so tests can show what a tool fetched and that it fetched
nothing else.

Entry points: ``egressctl lab up|down|status`` (egress/cli/lab_cmds.py), the ``lab``
pytest fixture (tests/privileged/conftest.py), and the ``Lab`` class::

    lab = Lab.up(name="egl1a2b")        # or Lab.load("egresslab") for one made by the CLI
    lab.run(["dig", f"@{lab.dns4}", "allowed.lab.test", "+short"])
    assert not lab.saw("denied.lab.test")
    lab.requests()                      # what the web server answered, oldest first
    lab.down()
"""

from __future__ import annotations

from egress.errors import LabError, LabExistsError, ZoneFileError
from egress.lab.control import DEFAULT_NAME, Lab
from egress.lab.querylog import read_query_log
from egress.lab.zones import DEFAULT_ZONES_FILE, ZoneSet, load_zones, parse_zones

__all__ = [
    "DEFAULT_NAME",
    "DEFAULT_ZONES_FILE",
    "Lab",
    "LabError",
    "LabExistsError",
    "ZoneFileError",
    "ZoneSet",
    "load_zones",
    "parse_zones",
    "read_query_log",
]
