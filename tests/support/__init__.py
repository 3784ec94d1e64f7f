"""What the privileged tests and the benchmarks share: the machinery around a real egress.

    netns.py       scratch namespaces and veth pairs, names unique to this process, the
                   check that this machine can make a netns at all, running as nobody
    labs.py        throwaway labs (egress.lab) with random short names, always torn down
    egressd.py     THE egressd start-up: options, wait for "serving", stderr to a file,
                   stop by PID, delete its sandboxes and tear down what it left by claim
    sandboxes.py   `egressctl run` with probe.py as the workload, and what it left behind
    probe.py       the scripted workload itself (stdlib only: it runs as nobody)
    probes.py      looking from outside: dig in a netns, the allow sets, waiting on a
                   condition (frozen, a line in a log) instead of sleeping
    dnsperf.py     dnsperf inside a sandbox, and its summary parsed
    tunnels.py     real iodine / dns2tcp / slow exfiltration against a sandbox, and the
                   benign corpus replay

Nothing here sends a packet off the machine: every address lives in a namespace these
helpers (or the lab) made, and each helper removes what it made, also on failure.
Benchmarks import this package as ``tests.support`` with the repository root on sys.path.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: egress/, tests/, bench/
# The workload runs stdlib-only code under Debian's python3 as nobody, who cannot read
# the venv.
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = 65534
