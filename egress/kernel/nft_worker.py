"""libnftables in a small child process, for a process that holds many descriptors.

libnftables 1.0.6 waits for the kernel's answer with select() (src/mnl.c): a context
whose netlink socket gets a descriptor of 1024 or above aborts the whole process
("bit out of range 0 - FD_SETSIZE"). egressd holds about eight descriptors per sandbox
it serves, so past ~120 sandboxes any libnftables call in it would kill every
sandbox's resolver at once. This child holds a handful of descriptors, forever below
1024, and runs each command there: the parent sends the netns, the text and the flags;
the child enters the netns, makes a fresh context (~0.06 ms), runs it and answers.

The resolver's hot path does not come here: set elements are written over egress's own
netlink socket (nft_sets.py), which never calls select(). What comes here is what
runs once per sandbox or per request: loading a ruleset, a policy swap, listing a set.

Protocol on stdin/stdout: a 4-byte big-endian length, then JSON. Request
``{"netns": str|null, "text": str, "json": bool, "dry": bool}``; answer
``{"rc": int, "out": str, "err": str}``. End of stdin (the parent is gone) ends it.
"""

from __future__ import annotations

import contextlib
import json
import select
import struct
import subprocess
import sys
import threading
from typing import IO, Any

from egress.errors import DatapathError, EgressError

_LEN = struct.Struct("!I")
ANSWER_TIMEOUT_S = 10.0  # a whole ruleset loads in ~5 ms; this is a hung child


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _read_message(stream: IO[bytes]) -> dict[str, Any] | None:
    head = _read_exact(stream, _LEN.size)
    if head is None:
        return None
    body = _read_exact(stream, _LEN.unpack(head)[0])
    if body is None:
        return None
    message: dict[str, Any] = json.loads(body)
    return message


def _write_message(stream: IO[bytes], message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    data = memoryview(_LEN.pack(len(body)) + body)
    while data:  # an unbuffered pipe may take part of it
        written = stream.write(data)
        data = data[written or 0 :]
    stream.flush()


def _serve() -> int:
    import nftables

    from egress.kernel.netns import in_netns

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (request := _read_message(stdin)) is not None:
        try:
            with in_netns(request["netns"]):
                ctx = nftables.Nftables()
                ctx.set_json_output(bool(request["json"]))
                ctx.set_dry_run(bool(request["dry"]))
                rc, out, err = ctx.cmd(request["text"])
                del ctx  # frees the context and its socket before the next request
        except (EgressError, OSError) as exc:
            rc, out, err = 1, "", str(exc)
        _write_message(stdout, {"rc": rc, "out": out, "err": err})
    return 0


class NftWorker:
    """The parent's side: one child, one request at a time (a lock serialises threads).

    A child that died is started again for the next request. A request the child may or
    may not have carried out before dying is reported as failed, never retried blindly.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.requests = 0
        self.restarts = 0

    def start(self) -> None:
        """Start the child now rather than on the first command (~0.1 s of imports)."""
        with self._lock:
            self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        if proc is not None:
            self.restarts += 1
            self._reap(proc)
        # -P: root must not import from whatever directory egressd was started in.
        self._proc = proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "egress.kernel.nft_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # one message per answer: poll() on the pipe tells the truth
            close_fds=True,
        )
        return proc

    def cmd(self, netns: str | None, text: str, as_json: bool, dry: bool) -> tuple[int, str, str]:
        request = {"netns": netns, "text": text, "json": as_json, "dry": dry}
        with self._lock:
            proc = self._start()
            try:
                try:
                    assert proc.stdin is not None
                    _write_message(proc.stdin, request)
                except BrokenPipeError:
                    # It died before it read a byte of this request: nothing was applied.
                    proc = self._start()
                    assert proc.stdin is not None
                    _write_message(proc.stdin, request)
                answer = self._answer(proc)
            except BaseException as exc:
                # Whatever it was doing, its answer must never be read as the next one's.
                proc.kill()
                proc.wait()
                self._proc = None
                self.restarts += 1
                if isinstance(exc, OSError):
                    raise DatapathError(f"the nft worker process failed: {exc}") from None
                raise
            self.requests += 1
        return int(answer["rc"]), str(answer["out"]), str(answer["err"])

    @staticmethod
    def _answer(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        assert proc.stdout is not None
        poller = select.poll()  # not select(): egressd's descriptors go past 1024
        poller.register(proc.stdout.fileno(), select.POLLIN)
        if not poller.poll(ANSWER_TIMEOUT_S * 1000):
            raise DatapathError(
                f"the nft worker gave no answer within {ANSWER_TIMEOUT_S:g} s; "
                "the command's outcome is unknown"
            )
        answer = _read_message(proc.stdout)
        if answer is None:
            raise DatapathError(
                "the nft worker process died during a command; its outcome is unknown"
            )
        return answer

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._reap(self._proc)
                self._proc = None

    @staticmethod
    def _reap(proc: subprocess.Popen[bytes]) -> None:
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):  # a broken pipe: the child is gone
                    stream.close()
        try:
            proc.wait(timeout=5)  # end of stdin ends it
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(_serve())
