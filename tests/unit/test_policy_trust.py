"""The policy is the operator's (egress.store.trust): every refusal rule, the sticky
exception, symlinks, and a swap between the checks and the read.

Files and directories are made in tmp_path and given owners with chown, so these need
root (the privileged suite runs them too); without it they are skipped.
"""

from __future__ import annotations

import grp
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from egress.errors import PolicyError
from egress.policy.loader import MAX_BYTES
from egress.store import trust
from egress.store.trust import TrustedPolicy, read_policy

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown to other users")

AGENT = 65534  # the workload: nobody, and its group nogroup
OTHER = 4242  # a user who is neither root nor the workload
TEXT = b"name: p\n"


def staff() -> tuple[int, str]:
    """A group that is neither root's nor the workload's."""
    for name in ("staff", "users", "adm"):
        try:
            return grp.getgrnam(name).gr_gid, name
        except KeyError:
            continue
    pytest.skip("no spare group (staff, users, adm) on this machine")


def read(path: Path | str, uids: object = None, gids: object = None) -> TrustedPolicy:
    return read_policy(
        str(path),
        workload_uids={AGENT} if uids is None else uids,  # type: ignore[arg-type]
        workload_gids={AGENT} if gids is None else gids,  # type: ignore[arg-type]
    )


def refusal(path: Path | str, **kw: object) -> str:
    with pytest.raises(PolicyError) as info:
        read(path, **kw)  # type: ignore[arg-type]
    assert len(info.value.problems) == 1
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture
def box(tmp_path: Path) -> Path:
    """A root-owned 0755 directory (tmp_path is 0700 root, inside sticky /tmp)."""
    d = tmp_path / "policies"
    d.mkdir()
    d.chmod(0o755)
    return d


def policy(directory: Path, mode: int = 0o644, uid: int = 0, gid: int = 0) -> Path:
    path = directory / "p.yaml"
    path.write_bytes(TEXT)
    os.chown(path, uid, gid)
    path.chmod(mode)
    return path


# -- accepted --------------------------------------------------------------------------


def test_a_root_file_in_root_directories_is_read_once_with_its_sha256(box: Path) -> None:
    got = read(policy(box))
    assert (got.data, got.sha256) == (TEXT, hashlib.sha256(TEXT).hexdigest())


def test_pytest_tmp_path_under_sticky_tmp_is_accepted(tmp_path: Path) -> None:
    """/tmp is 1777; /tmp/pytest-of-root is root's: the sticky exception holds."""
    assert os.stat("/tmp").st_mode & 0o1002 == 0o1002
    assert read(policy(tmp_path)).data == TEXT


def test_workload_identities_may_be_any_container(box: Path) -> None:
    path = policy(box, uid=AGENT + 5)
    assert "owned by the workload's user" in refusal(path, uids=range(AGENT, AGENT + 10))
    assert read(path, uids=range(100_000, 165_536), gids=range(100_000, 165_536)).data == TEXT


def test_a_directory_writable_by_a_group_the_workload_is_not_in_is_accepted(box: Path) -> None:
    gid, _ = staff()
    os.chown(box, 0, gid)
    box.chmod(0o775)
    assert read(policy(box)).data == TEXT


# -- the file --------------------------------------------------------------------------


def test_group_writable_file_is_refused_naming_the_group(box: Path) -> None:
    gid, name = staff()
    path = policy(box, 0o664, gid=gid)
    assert refusal(path) == f"{path}: writable by group '{name}' (mode 0664); chmod g-w it"


def test_other_writable_file_is_refused(box: Path) -> None:
    path = policy(box, 0o646)
    assert refusal(path) == f"{path}: writable by everyone (mode 0646); chmod o-w it"


def test_group_and_other_writable_file_says_both(box: Path) -> None:
    gid, name = staff()
    path = policy(box, 0o666, gid=gid)
    assert refusal(path) == (
        f"{path}: writable by group '{name}' and everyone (mode 0666); chmod go-w it"
    )


def test_file_owned_by_the_workload_is_refused_even_read_only(box: Path) -> None:
    path = policy(box, 0o444, uid=AGENT)
    assert refusal(path) == (
        f"{path}: owned by the workload's user 'nobody' (uid {AGENT}); chown root it"
    )


def test_file_of_the_workloads_group_with_group_write_is_refused(box: Path) -> None:
    path = policy(box, 0o664, gid=AGENT)
    assert refusal(path) == (
        f"{path}: writable by the workload's group 'nogroup' (mode 0664); chmod g-w it"
    )


def test_not_a_regular_file_is_refused_without_blocking(box: Path) -> None:
    fifo = box / "fifo.yaml"
    os.mkfifo(fifo)
    assert refusal(fifo) == f"{fifo}: not a regular file"
    assert refusal(box) == f"{box}: not a regular file"


def test_a_missing_file_says_it_cannot_be_read(box: Path) -> None:
    assert (
        refusal(box / "nope.yaml") == f"{box / 'nope.yaml'}: cannot read: No such file or directory"
    )


# -- the directories -------------------------------------------------------------------


def test_directory_owned_by_the_workload_is_refused(box: Path) -> None:
    path = policy(box)
    os.chown(box, AGENT, 0)
    assert refusal(path) == (
        f"{path}: directory {box} is owned by the workload's user 'nobody' (uid {AGENT}); "
        f"chown root {box}"
    )


def test_directory_writable_by_the_workloads_group_is_refused(box: Path) -> None:
    path = policy(box)
    os.chown(box, 0, AGENT)
    box.chmod(0o775)
    assert refusal(path) == (
        f"{path}: directory {box} is writable by the workload's group 'nogroup' "
        f"(mode 0775); chmod g-w {box}"
    )


def test_other_writable_directory_is_refused(box: Path) -> None:
    path = policy(box)
    box.chmod(0o777)
    assert refusal(path) == (
        f"{path}: directory {box} is writable by everyone (mode 0777); chmod o-w {box}"
    )


def test_an_unsafe_directory_higher_up_is_found(box: Path) -> None:
    deep = box / "a" / "b"
    deep.mkdir(parents=True)
    path = policy(deep)
    (box / "a").chmod(0o777)
    assert f"directory {box / 'a'} is writable by everyone" in refusal(path)


def test_a_relative_path_is_checked_from_the_root(
    box: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy(box)
    box.parent.chmod(0o777)
    monkeypatch.chdir(box)
    assert refusal("p.yaml") == (
        f"p.yaml: directory {box.parent} is writable by everyone (mode 0777); "
        f"chmod o-w {box.parent}"
    )


# -- the sticky exception --------------------------------------------------------------


@pytest.fixture
def sticky(box: Path) -> Path:
    """A /tmp of our own: 1777, root's."""
    d = box / "tmp"
    d.mkdir()
    d.chmod(0o1777)
    return d


def test_sticky_directory_is_accepted_when_the_entry_is_roots(sticky: Path) -> None:
    assert read(policy(sticky)).data == TEXT
    sub = sticky / "sub"
    sub.mkdir()
    sub.chmod(0o755)
    assert read(policy(sub)).data == TEXT


def test_sticky_directory_is_refused_when_the_entry_is_the_workloads(sticky: Path) -> None:
    sub = sticky / "sub"
    sub.mkdir()
    sub.chmod(0o755)
    path = policy(sub)
    os.chown(sub, AGENT, AGENT)
    assert refusal(path) == (
        f"{path}: {sub} is owned by the workload's user 'nobody' (uid {AGENT}), in sticky "
        f"directory {sticky} the workload may write (mode 1777); chown root {sub}, or keep "
        "the policy elsewhere"
    )


def test_sticky_directory_is_refused_when_the_entry_is_someone_elses(sticky: Path) -> None:
    path = policy(sticky, uid=OTHER)
    message = refusal(path)
    assert f"{path} is owned by uid {OTHER}, not root or you, in sticky directory" in message


def test_in_a_sticky_directory_the_invoking_user_counts_as_trusted(
    sticky: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = policy(sticky, uid=OTHER)
    monkeypatch.setattr(trust.os, "getuid", lambda: OTHER)
    assert read(path).data == TEXT
    assert "owned by the workload's user" in refusal(path, uids={OTHER})  # never the workload


def test_a_sticky_directory_the_workload_owns_gets_no_exception(sticky: Path) -> None:
    path = policy(sticky)
    os.chown(sticky, AGENT, 0)
    assert f"directory {sticky} is owned by the workload's user" in refusal(path)


# -- symlinks: the path as given and its realpath --------------------------------------


def test_a_symlink_into_an_unsafe_directory_is_refused(box: Path) -> None:
    unsafe = box / "unsafe"
    unsafe.mkdir()
    policy(unsafe)
    unsafe.chmod(0o777)
    (box / "link").symlink_to(unsafe)
    assert f"directory {unsafe} is writable by everyone" in refusal(box / "link" / "p.yaml")


def test_a_symlink_living_in_an_unsafe_directory_is_refused(box: Path) -> None:
    safe = box / "safe"
    safe.mkdir()
    target = policy(safe)
    unsafe = box / "unsafe"
    unsafe.mkdir()
    (unsafe / "p.yaml").symlink_to(target)
    unsafe.chmod(0o777)
    assert f"directory {unsafe} is writable by everyone" in refusal(unsafe / "p.yaml")
    assert read(target).data == TEXT


def test_a_workloads_symlink_in_a_sticky_directory_is_refused(sticky: Path, box: Path) -> None:
    target = policy(box)
    link = sticky / "p.yaml"
    link.symlink_to(target)
    os.chown(link, AGENT, AGENT, follow_symlinks=False)
    assert f"{link} is owned by the workload's user" in refusal(link)


def test_dot_dot_after_a_symlink_is_resolved_as_the_kernel_does(box: Path) -> None:
    """link/../p.yaml is real/../p.yaml: the file beside the link's target, not box's."""
    real = box / "deep" / "real"
    real.mkdir(parents=True)
    policy(box / "deep")
    (box / "link").symlink_to(real)
    (box / "deep").chmod(0o777)  # only the physical path passes through it
    assert f"directory {box / 'deep'} is writable by everyone" in refusal(
        box / "link" / ".." / "p.yaml"
    )


def test_a_symlink_loop_is_refused(box: Path) -> None:
    (box / "a").symlink_to(box / "b")
    (box / "b").symlink_to(box / "a")
    assert "cannot read: Too many levels of symbolic links" in refusal(box / "a")


# -- between the checks and the read ---------------------------------------------------


def _between_check_and_open(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> None:
    real_open = trust._open

    def swapped(real: str) -> int:
        act()
        return real_open(real)

    monkeypatch.setattr(trust, "_open", swapped)


def test_a_file_swapped_in_after_the_checks_is_refused(
    box: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attacker's file passes every check by itself: only its identity gives it away."""
    path = policy(box)
    other = box / "other.yaml"
    other.write_bytes(b"name: attacker\n")
    _between_check_and_open(monkeypatch, lambda: os.replace(other, path))
    assert refusal(path) == (
        f"{path}: was replaced while it was being checked; run the command again"
    )


def test_a_mode_loosened_after_the_checks_is_refused_by_fstat(
    box: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = policy(box)
    _between_check_and_open(monkeypatch, lambda: path.chmod(0o666))
    assert "writable by group 'root' and everyone (mode 0666)" in refusal(path)


def test_what_is_parsed_and_hashed_is_what_was_opened(
    box: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the open a swap changes nothing: the bytes come from the checked descriptor."""
    path = policy(box)
    other = box / "other.yaml"
    other.write_bytes(b"name: attacker\n")
    real_open = trust._open

    def open_then_swap(real: str) -> int:
        fd = real_open(real)
        os.replace(other, path)
        return fd

    monkeypatch.setattr(trust, "_open", open_then_swap)
    got = read(path)
    assert (got.data, got.sha256) == (TEXT, hashlib.sha256(TEXT).hexdigest())
    assert path.read_bytes() == b"name: attacker\n"


def test_it_reads_one_byte_past_the_limit_so_the_parser_can_refuse(box: Path) -> None:
    assert trust.DEFAULT_MAX_BYTES == MAX_BYTES
    path = policy(box)
    path.write_bytes(b"#" * (MAX_BYTES + 100))
    assert len(read(path).data) == MAX_BYTES + 1


# -- egressctl sandbox create / set-policy: refused in the client, before egressd -------


def test_sandbox_create_and_set_policy_refuse_before_sending(
    box: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from egress.cli.main import main

    monkeypatch.delenv("SUDO_USER", raising=False)  # the default exec user: nobody
    gid, name = staff()
    path = policy(box, 0o664, gid=gid)
    nowhere = ["--daemon", str(box / "no-egressd.sock")]
    commands = (["sandbox", "create", "--policy", str(path), *nowhere],
                ["sandbox", "set-policy", "abc123", "--policy", str(path), *nowhere])  # fmt: skip
    for argv in commands:
        assert main(argv) == 2, argv
        assert capsys.readouterr().err == (
            f"{path}: writable by group '{name}' (mode 0664); chmod g-w it\n"
        )
    path.chmod(0o644)  # now it is sent, and only then found to have nobody to go to
    for argv in commands:
        assert main(argv) == 1, argv
        assert "egressd" in capsys.readouterr().err


def test_sandbox_create_checks_against_the_sandbox_uid_range(
    box: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """egressd gives each sandbox a uid of the range: a file any of them owns is refused."""
    from egress.cli.main import main

    monkeypatch.setenv("EGRESS_UID_RANGE", f"{AGENT}-{AGENT + 10}")
    path = policy(box, 0o444, uid=AGENT)
    assert main(["sandbox", "create", "--policy", str(path), "--daemon", "/nonexistent"]) == 2
    assert "owned by the workload's user 'nobody'" in capsys.readouterr().err
