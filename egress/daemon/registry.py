"""The sandboxes one egressd serves, all on one event loop.

Each served sandbox is the same inline layer `egressctl run` wires (``Session``: NFLOG
reader, Enforcer, journal writer; ``ResolverServer`` on 127.0.0.53 in its netns), so the
daemon and the embedded mode share every line of enforcement. Netns, veth and cgroup are
made (``sandbox.create``) or attached (``attach.attach``) in a worker thread: they block
(netlink, sysctls, the nft worker, a process's first iptables-nft exec), and pyroute2's
synchronous API (teardown's) runs an event loop of its own, which this thread may not.

    create ─▶ [thread] sandbox.create ─▶ [thread] journal ─▶ Session + resolver
                                                            ─▶ [thread] run-dir record
    attach ─▶ [thread] attach.attach  ─▶ [thread] journal ─▶ Session + resolver
                                                            ─▶ [thread] run-dir record
    delete ─▶ stop serving (the session's writer drains) ─▶ [thread] Sandbox.destroy
              (teardown or detach) ─▶ [thread] record removed, journal
    stop (SIGTERM) ─▶ stop serving; the kernel keeps enforcing; records stay for adoption

The journal's and the record's writes are fsync'd: in a thread, the loop answers every
other sandbox meanwhile. Any failure half-way undoes what that request made, so nothing
is left half-created.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from egress.collect import Collector
from egress.daemon.lag import LoopLag
from egress.datapath import constants as c
from egress.datapath.addressing import Pools
from egress.errors import (
    AlreadyAttached,
    Busy,
    Conflict,
    EgressError,
    NotFound,
    SandboxError,
    UpstreamError,
)
from egress.freeze import review
from egress.inline import wiring
from egress.inline.session import REVIEW_POLL_MAX_S, Session
from egress.inline.swap import TrackingResolver, swap
from egress.inline.upstream import parse_upstream, resolve_upstreams
from egress.kernel.nflog import NflogListener
from egress.kernel.nfqueue import NfqueueListener
from egress.model import Policy, ReviewAction, SandboxKind, SandboxState
from egress.policy import parse_policy
from egress.sandbox import attach as attach_mod
from egress.sandbox import lifecycle as sbx
from egress.sandbox.adopt import adopt_created
from egress.store import rundir, uids
from egress.store.journal import Journal

from . import handoff

if TYPE_CHECKING:
    from egress.daemon.figures import KernelFigures  # it imports this module

_T = TypeVar("_T")
_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}\Z")


@dataclass
class Served:
    record: rundir.Record
    sb: sbx.Sandbox
    session: Session
    resolver: TrackingResolver
    started: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.sb.id

    def rules_present(self) -> bool:
        """Its table inet egress is in its netns (someone may have deleted it). A handle
        of its own: this runs on a worker thread, and libnftables' are not shared."""
        from egress.kernel.nft import NftHandle

        try:
            with NftHandle.open(self.sb.reach, label=self.sb.netns) as nft:
                return nft.table_exists("inet", c.TABLE)
        except EgressError:
            return False

    def _create_ms(self) -> dict[str, float]:
        """The create's (or attach's) ms, in all and by step; {} if adopted, not made here."""
        if not self.sb.created_s:
            return {}
        return {"total": round(self.sb.created_s * 1000, 2), **self.sb.create_steps_ms}

    def to_json(self) -> dict[str, Any]:
        r = self.record
        frozen = False
        with contextlib.suppress(EgressError, OSError):
            frozen = self.sb.cgroup.is_frozen()
        return {
            "id": self.id,
            "kind": r.kind,
            "policy": self.sb.policy.name,
            "policy_sha256": r.policy_sha256,
            "mode": self.sb.policy.mode.value,
            "state": SandboxState.FROZEN if frozen else SandboxState.RUNNING,
            "netns": r.netns,
            "cgroup": r.cgroup,
            "freezer": r.freezer,
            "cpu": self.sb.cgroup.cpu_path,  # the v1 cpu twin of one egress made, if any
            "pids": self.sb.cgroup.pids_path,  # its v1 pids twin (spec.limits.pids), if any
            "memory": self.sb.cgroup.memory_path,  # its v1 memory twin, if any
            "uplink_netns": r.uplink_netns,
            "upstream": r.upstream,
            "uid": r.uid,  # the workload's own uid and gid (created sandboxes)
            "owner": r.owner,
            "address4": None if r.kind == SandboxKind.ATTACHED else str(self.sb.net.address4),
            "created_at": r.created_at,
            "create_ms": self._create_ms(),
            "violations": len(self.session.state.violations),
            "dns": self.resolver.core.stats,
        }


class Registry:
    def __init__(
        self,
        journal: Journal,
        run_dir: Path,
        pools: Pools | None = None,
        review_hint: str = "",
        uid_range: range | None = None,
    ) -> None:
        self.journal = journal
        self.uid_range = uid_range if uid_range is not None else uids.parse_range(None)
        self.run_dir = run_dir
        self.pools = pools or Pools.parse(None)
        self.review_hint = review_hint
        self.served: dict[str, Served] = {}
        self._claimed: set[str] = set()  # ids being made right now
        self.created_total = 0
        self.paused = False  # sockets are being handed to a successor egressd
        self._in_flight = 0  # creates, attaches and deletes under way
        self._settled = asyncio.Event()
        self._settled.set()
        self.collector: Collector | None = None  # egressd's own; none in tests
        self.lag: LoopLag | None = None  # egressd's own (daemon/lag.py); none in tests
        # egressd's own (daemon/figures.py); none in tests: no kernel figures in /metrics
        self.figures: KernelFigures | None = None

    # -- reading -------------------------------------------------------------------------

    def list(self) -> list[Served]:
        return sorted(self.served.values(), key=lambda s: s.record.created_at)

    def get(self, sandbox_id: str) -> Served:
        try:
            return self.served[sandbox_id]
        except KeyError:
            raise NotFound(
                f"no sandbox {sandbox_id!r} is served by this egressd", where=sandbox_id
            ) from None

    def _changing(self) -> None:
        if self.paused:
            raise Busy("egressd is handing over to a new egressd; retry in a moment")

    @contextlib.asynccontextmanager
    async def _change(self) -> AsyncIterator[None]:
        """A create, attach or delete: refused while handing over, and counted, so a
        handover waits until none is half-done (``settled``)."""
        self._changing()
        self._in_flight += 1
        self._settled.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._settled.set()

    async def settled(self) -> None:
        """Return once no create, attach or delete is under way."""
        await self._settled.wait()

    # -- making --------------------------------------------------------------------------

    async def create(
        self, policy_text: str, uplink_netns: str | None = None, upstream: str | None = None
    ) -> Served:
        async with self._change():
            served = await self._create(policy_text, uplink_netns, upstream)
        _log(f"created {served.id} (policy {served.sb.policy.name}, netns {served.sb.netns})")
        return served

    async def _create(
        self, policy_text: str, uplink_netns: str | None, upstream: str | None
    ) -> Served:
        started = time.monotonic()
        policy = parse(policy_text)
        upstreams = _upstreams(policy, upstream)
        sb = await _in_thread(
            sbx.create, policy, self.pools, uplink_netns, self.uid_range, self._id_taken
        )
        record = rundir.Record(
            id=sb.id, kind=SandboxKind.CREATED, netns=sb.netns, cgroup=sb.cgroup.v2_path,
            policy=policy_text, freezer=sb.cgroup.freezer_path, uplink_netns=uplink_netns,
            upstream=upstream, created_at=time.time(), daemon_pid=os.getpid(), uid=sb.uid,
        )  # fmt: skip
        return await self._serve(sb, record, upstreams, fresh=True, started=started)

    async def attach(
        self,
        netns_ref: str,
        cgroup: str | None,
        policy_text: str,
        *,
        freezer: str | None = None,
        uplink_netns: str | None = None,
        upstream: str | None = None,
        sandbox_id: str | None = None,
        owner: str | None = None,
    ) -> Served:
        """``cgroup`` None: bound later, from the processes in the netns (a CNI ADD)."""
        async with self._change():
            served = await self._attach(
                netns_ref, cgroup, policy_text, freezer, uplink_netns, upstream, sandbox_id,
                owner,
            )  # fmt: skip
        _log(f"attached {served.id} (policy {served.sb.policy.name}, netns {netns_ref})")
        return served

    async def _attach(
        self,
        netns_ref: str,
        cgroup: str | None,
        policy_text: str,
        freezer: str | None,
        uplink_netns: str | None,
        upstream: str | None,
        sandbox_id: str | None,
        owner: str | None,
    ) -> Served:
        started = time.monotonic()
        policy = parse(policy_text)
        upstreams = _upstreams(policy, upstream)
        sid = self._claim_id(sandbox_id)
        try:
            self._check_netns_free(netns_ref)
            try:
                sb, lo_raised = await _in_thread(
                    attach_mod.attach, sid, policy, netns_ref, cgroup, freezer
                )
            except AlreadyAttached as exc:
                raise Conflict(str(exc)) from None
            record = rundir.Record(
                id=sid, kind=SandboxKind.ATTACHED, netns=netns_ref, cgroup=sb.cgroup.v2_path,
                policy=policy_text, freezer=sb.cgroup.freezer_path, uplink_netns=uplink_netns,
                upstream=upstream, lo_raised=lo_raised, created_at=time.time(),
                daemon_pid=os.getpid(), owner=owner,
                netns_inode=list(sb.netns_id or _inode(netns_ref)),
            )  # fmt: skip
            return await self._serve(sb, record, upstreams, fresh=True, started=started)
        finally:
            self._claimed.discard(sid)

    def _id_taken(self, sandbox_id: str) -> bool:
        """Served, being attached, or journaled once (the journal refuses an id twice)."""
        return (
            sandbox_id in self.served
            or sandbox_id in self._claimed
            or self.journal.sandbox(sandbox_id) is not None
        )

    def _claim_id(self, wanted: str | None) -> str:
        if wanted is None:
            wanted = sbx.draw_id(self._id_taken)
        elif not _ID.match(wanted):
            raise SandboxError(f"sandbox id {wanted!r}: use 1-32 of a-z 0-9 _ - (first a-z0-9)")
        if self._id_taken(wanted):
            raise Conflict(f"sandbox id {wanted!r} is already in use")
        self._claimed.add(wanted)
        return wanted

    def _check_netns_free(self, netns_ref: str) -> None:
        try:
            target = _inode(netns_ref)
        except OSError:
            return  # attach reports the missing netns precisely
        for s in self.served.values():
            with contextlib.suppress(OSError):
                if _inode(s.sb.reach) == target:
                    raise Conflict(f"netns {netns_ref} is already served as sandbox {s.id}")

    async def _serve(
        self,
        sb: sbx.Sandbox,
        record: rundir.Record,
        upstreams: builtins.list[tuple[str, int]],
        fresh: bool,
        handed: handoff.Handed | None = None,
        started: float | None = None,
    ) -> Served:
        """Serve a made (or adopted) sandbox; on failure a fresh one is torn down again.
        ``started``: when its create or attach began (monotonic), for its create_ms."""
        session: Session | None = None
        resolver: TrackingResolver | None = None
        saving: asyncio.Future[None] | None = None
        # A fresh sandbox's create_ms: its steps after lifecycle's (from when the worker
        # thread's result reached this loop), and in all from the request's start.
        mark = time.monotonic()

        def done(step: str) -> None:
            nonlocal mark
            now = time.monotonic()
            if fresh:
                sb.create_steps_ms[step] = round((now - mark) * 1000, 2)
                if started is not None:
                    sb.created_s = now - started
            mark = now

        try:
            if fresh:
                # Commits (fsync'd) in a thread, as the record's save below: on the loop
                # they stalled every sandbox's answers for up to ~18 ms at each create.
                await _in_thread(functools.partial(
                    self.journal.record_sandbox,
                    sb.id, sb.policy.name, netns=sb.netns, cgroup=sb.cgroup.v2_path,
                    inline_pid=os.getpid(), owner_pid=os.getpid(),
                    freezer=sb.cgroup.freezer_path, policy_sha256=record.policy_sha256,
                    uid=sb.uid,
                ))  # fmt: skip
                done("journal")
            if sb.cgroup.netns is not None:  # found from its processes: record each find
                loop = asyncio.get_running_loop()
                # Called on whichever thread froze, after the freeze's discovery: the
                # record and journal are written on the loop, not in the freeze's path.
                sb.cgroup.on_bind = lambda cg: loop.call_soon_threadsafe(
                    self._bound, record, cg.v2_path, cg.freezer_path
                )
            session, resolver = await self._start(sb, record, upstreams, fresh, handed)
            done("serve")
            saving = asyncio.get_running_loop().run_in_executor(
                None, rundir.save, self.run_dir, record
            )
            await asyncio.shield(saving)  # cancelled or not, the save goes on to the end
            done("record")
        except BaseException:
            if saving is not None:
                while not saving.done():  # cancelled again meanwhile: still wait for it
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(saving)
                if fresh:  # its record must not outlive it (an adopted one's stays)
                    with contextlib.suppress(OSError):
                        rundir.remove(self.run_dir, record.id)
            await self._stop(session, resolver)
            if handed is not None:
                handed.close()  # ours only: the previous egressd's copies are its own
            if fresh:
                await _in_thread(_destroy_quietly, sb)
                with contextlib.suppress(EgressError):
                    self.journal.set_sandbox_state(sb.id, SandboxState.EXITED)
            raise
        served = self.served[sb.id] = Served(record, sb, session, resolver)
        if self.collector is not None:
            self.collector.made()
        self.created_total += fresh
        return served

    async def _start(
        self,
        sb: sbx.Sandbox,
        record: rundir.Record,
        upstreams: builtins.list[tuple[str, int]],
        fresh: bool,
        handed: handoff.Handed | None,
    ) -> tuple[Session, TrackingResolver]:
        listener, queue = None, None
        if handed is not None:  # the predecessor may still serve with them
            listener = NflogListener(handed.nflog, c.INLINE_GROUP, sb.netns)
            listener.shared = True
            if handed.nfqueue is not None:
                queue = NfqueueListener(handed.nfqueue, c.FIRST_BYTES_QUEUE, sb.netns)
                queue.shared = True
        session, resolver = wiring.make(
            sb, self.journal, self.review_hint, upstreams, record.uplink_netns,
            listener=listener, queue=queue, review_poll_max_s=REVIEW_POLL_MAX_S,
        )  # fmt: skip
        try:
            if not fresh:
                # Adopted: what an earlier egressd's answers put in the sets keeps its
                # expiry (no later answer shortens it), and, if it handed over, which
                # question put it there (so a policy swap keeps what is still allowed).
                resolver.seed_expiry(inherit=handed is None)
                if handed is not None:
                    resolver.restore(handed.learned)
            await resolver.start(None if handed is None else (handed.udp, handed.tcp))
        except BaseException:
            await wiring.stop(session, None)
            raise
        return session, resolver

    async def _stop(
        self,
        session: Session | None,
        resolver: TrackingResolver | None,
        handed_over: bool = False,
    ) -> None:
        await wiring.stop(session, resolver, handed_over)

    # -- adoption ------------------------------------------------------------------------

    async def adopt(self, handed: dict[str, handoff.Handed] | None = None) -> builtins.list[str]:
        """Serve every sandbox a previous egressd left in the run dir (with the sockets
        it handed over, if it did); returns problems."""
        handed = dict(handed or {})
        problems = []
        for record in rundir.load_all(self.run_dir):
            if record.id in self.served:
                continue
            try:
                await self._adopt(record, handed.pop(record.id, None))
            except EgressError as exc:
                problems.append(f"sandbox {record.id}: not adopted: {exc}")
        for sandbox_id, leftover in handed.items():
            problems.append(f"sandbox {sandbox_id}: handed over but has no record; not served")
            leftover.close()
        return problems

    def _bound(self, record: rundir.Record, v2: str, freezer: str | None) -> None:
        """An attached sandbox's cgroup was found from its processes: kept in its record
        and the journal (what the next egressd and `egressctl resume` act on)."""
        if record.id not in self.served or record.cgroup == v2:
            return
        record.cgroup, record.freezer, record.cgroup_found = v2, freezer, True
        try:
            rundir.save(self.run_dir, record)
            self.journal.update_sandbox(record.id, cgroup=v2, freezer=freezer)
        except (EgressError, OSError) as exc:
            print(f"egressd: {record.id}: could not record its cgroup {v2}: {exc}",
                  file=sys.stderr)  # fmt: skip
        _log(f"bound {record.id} to cgroup {v2} (its processes')")

    async def _adopt(self, record: rundir.Record, handed: handoff.Handed | None) -> None:
        policy = parse(record.policy)
        upstreams = _upstreams(policy, record.upstream)
        if record.kind == SandboxKind.CREATED:
            sb = await _in_thread(adopt_created, record, policy)
        else:
            # adopt refuses a netns that is not the recorded one (/proc/PID/ns/net of a
            # reused PID), looked at through the descriptor it then goes on with.
            sb = await _in_thread(
                attach_mod.adopt, record.id, policy, record.netns, record.cgroup,
                record.freezer, record.lo_raised, record.cgroup_found or not record.cgroup,
                None if record.netns_inode is None else tuple(record.netns_inode),
            )  # fmt: skip
        record.daemon_pid = os.getpid()
        try:
            await self._serve(sb, record, upstreams, fresh=False, handed=handed)
        except BaseException:
            sb.release()
            raise
        with contextlib.suppress(EgressError):
            self.journal.set_sandbox_state(
                record.id, "frozen" if sb.cgroup.is_frozen() else "running",
                inline_pid=os.getpid(),
            )  # fmt: skip

    # -- acting --------------------------------------------------------------------------

    async def decide(self, sandbox_id: str, action: str, uid: int, note: str = "") -> None:
        """A person's resume or kill: journaled first (with the caller's uid), then done."""
        served = self.get(sandbox_id)
        cgroup = served.sb.cgroup
        if action == ReviewAction.RESUME and not cgroup.is_frozen():
            raise Conflict(f"sandbox {sandbox_id} is not frozen; nothing to resume")
        if action == ReviewAction.KILL:
            self.journal.record_decision(sandbox_id, action, uid, time.time(), note)
            await _in_thread(cgroup.kill)
            _log(f"kill {sandbox_id} by uid {uid}")
            return
        try:  # off the loop: the journal's lock may be held for its busy timeout
            await _in_thread(review.resume, self.journal, cgroup, sandbox_id, uid, note)
        except review.StillFrozen as exc:
            _log(f"resume {sandbox_id} by uid {uid}: {exc}")
            raise
        _log(f"resume {sandbox_id} by uid {uid}")

    async def delete(self, sandbox_id: str) -> None:
        """Tear down what egress made, or detach from what it didn't."""
        async with self._change():
            await self._delete(sandbox_id)
        _log(f"deleted {sandbox_id}")

    async def _delete(self, sandbox_id: str) -> None:
        served = self.get(sandbox_id)
        del self.served[sandbox_id]
        if self.collector is not None:
            self.collector.changed()
        await self._stop(served.session, served.resolver)
        try:
            await _in_thread(served.sb.destroy)
        finally:
            await _in_thread(self._ended, sandbox_id)

    def _ended(self, sandbox_id: str) -> None:
        rundir.remove(self.run_dir, sandbox_id)
        with contextlib.suppress(EgressError):
            self.journal.set_sandbox_state(sandbox_id, SandboxState.EXITED)

    def set_policy(self, sandbox_id: str, policy_text: str) -> dict[str, Any]:
        """Swap the policy in one event-loop turn: nft rules, set elements, resolver."""
        self._changing()
        served = self.get(sandbox_id)
        policy = parse(policy_text)
        if served.record.upstream is None:
            wanted = resolve_upstreams(policy.dns.upstreams)
            if wanted != served.resolver.upstreams:
                raise Conflict(
                    "dns.upstreams differs from the served policy's; upstreams are not "
                    "swapped live (delete and create the sandbox, or create it with upstream)"
                )
        start = time.monotonic()
        removed = swap(served.sb, served.resolver, policy)
        _log(f"{sandbox_id}: policy {policy.name} in force ({removed} set elements removed)")
        served.session.enforcer.policy = policy
        served.record.policy = policy_text
        with contextlib.suppress(OSError):
            rundir.save(self.run_dir, served.record)
        with contextlib.suppress(EgressError):  # what `egressctl ps` shows
            state = SandboxState.FROZEN if served.sb.cgroup.is_frozen() else SandboxState.RUNNING
            self.journal.set_sandbox_state(
                sandbox_id, state, policy=policy.name, policy_sha256=served.record.policy_sha256
            )
        return {"removed_elements": removed, "swap_ms": round((time.monotonic() - start) * 1e3, 2)}

    # -- handing over -------------------------------------------------------------------

    def pause(self, paused: bool) -> None:
        self.paused = paused

    def offers(self) -> builtins.list[handoff.Offer]:
        """Each served sandbox's sockets and learned addresses, for a successor."""
        out = []
        for s in self.list():
            s.session.listener.shared = True  # from now on a successor may hold them too
            flows = s.session.flows
            assert flows is not None  # wiring.make made it
            flows.listener.shared = True
            udp, tcp = s.resolver.listening
            out.append(
                handoff.Offer(s.id, udp, tcp, s.session.listener.sock, flows.listener.sock,
                              s.resolver.learned_list())
            )  # fmt: skip
        return out

    async def close(self, handed_over: bool = False, drain_s: float = 3.0) -> None:
        """Stop serving; every sandbox's kernel rules and run-dir record stay.

        ``handed_over``: a successor reads every socket now. Stop reading, answer what
        was already sent upstream (at most ``drain_s``), keep the NFLOG groups bound.
        """
        loop = asyncio.get_running_loop()
        if handed_over:
            for served in self.served.values():
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(served.session.listener.fileno())
                if served.session.flows is not None:
                    served.session.flows.stop_reading()
            await asyncio.gather(*(s.resolver.drain(drain_s) for s in self.served.values()))
        for served in list(self.served.values()):
            await self._stop(served.session, served.resolver, handed_over)
            served.sb.release()
        self.served.clear()


def parse(policy_text: str) -> Policy:
    policy, _ = parse_policy(policy_text, "<api>")
    return policy


def _upstreams(policy: Policy, upstream: str | None) -> list[tuple[str, int]]:
    if upstream is not None:
        return [parse_upstream(upstream)]
    found = resolve_upstreams(policy.dns.upstreams)
    if not found:
        raise UpstreamError("the policy names no upstream and none was given")
    return found


def _inode(netns_ref: str) -> tuple[int, int]:
    from egress.kernel.netns import netns_id

    found = netns_id(netns_ref)
    if found is None:
        raise FileNotFoundError(f"netns {netns_ref} is gone")
    return found


def _log(line: str) -> None:
    print(f"egressd: {line}", file=sys.stderr, flush=True)


def _destroy_quietly(sb: sbx.Sandbox) -> None:
    try:
        sb.destroy()
    except EgressError as exc:
        print(f"egressd: {exc}", file=sys.stderr)


async def _in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
