"""A real egressd on a temporary socket, for the privileged tests that drive its API.

``egressd(state)`` starts one (its own socket, run dir and stderr file in a temp dir) and,
on the way out, deletes every sandbox it still serves through the API, stops it, tears
down by their claims the sandboxes of ours that an egressd stopped on purpose left behind,
and removes the temp dir, whether the test passed or not.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from egress.cli.daemon_cmds import Client, DaemonError
from egress.kernel.nft import NftHandle
from egress.sandbox.lifecycle import teardown_claim
from egress.store import claims

ROOT = Path(__file__).resolve().parents[2]


class Daemon:
    def __init__(self, directory: Path, state: Path) -> None:
        self.dir = directory
        self.socket = str(directory / "egressd.sock")
        self.run_dir = directory / "run"
        self.state = state
        self.made: list[str] = []
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "egress.daemon.main", "--socket", self.socket,
                "--run-dir", str(self.run_dir), "--state-dir", str(self.state)]  # fmt: skip
        # stderr to a file: a pipe nobody reads fills up (a review block per freeze) and
        # would block the daemon mid-write.
        with open(self.dir / "stderr", "a") as err:
            self.proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "serving" in line, self.stop()

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Stop it (if it runs); returns what it wrote to stderr so far."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.communicate(timeout=30)
        return self.stderr()

    def stderr(self) -> str:
        try:
            return (self.dir / "stderr").read_text(errors="replace")
        except OSError:
            return ""

    @property
    def client(self) -> Client:
        return Client(self.socket)

    def create(self, text: str, uplink: str) -> dict[str, Any]:
        data = self.client.call("POST", "/v1/sandboxes", {"policy": text, "uplink_netns": uplink})
        self.made.append(data["id"])
        return dict(data)

    def cleanup(self) -> None:
        """Delete what is still served, stop, tear down what a stopped egressd left."""
        with suppress(DaemonError):
            for row in self.client.call("GET", "/v1/sandboxes"):
                with suppress(DaemonError):
                    self.client.call("DELETE", f"/v1/sandboxes/{row['id']}")
        self.stop()
        for claim in claims.load_all():
            if claim.id in self.made:
                teardown_claim(claim)


@contextmanager
def egressd(state: Path) -> Iterator[Daemon]:
    directory = Path(tempfile.mkdtemp(prefix="egressd-test-"))
    daemon = Daemon(directory, state)
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()
        subprocess.run(["rm", "-rf", str(directory)], check=False)


def dig(netns: str, name: str, server: str = "127.0.0.53") -> str:
    argv = ["ip", "netns", "exec", netns, "dig", "+short", "+tries=1", "+time=2", f"@{server}"]
    done = subprocess.run([*argv, name], capture_output=True, text=True, timeout=20)
    return "\n".join(x for x in done.stdout.splitlines() if not x.startswith(";;")).strip()


def set_ips(netns: str) -> set[str]:
    """The addresses in the sandbox's ``allow4`` set (elements are ip . proto . port)."""
    with NftHandle.open(netns) as nft:
        return {e["key"].split(" . ")[0] for e in nft.list_set("inet", "egress", "allow4")}
