"""egress-cni's pure parts: the call from the environment and stdin, the policy a pod
gets, and the common cgroup of a netns's processes (issue 15)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from egress.cli.cni import (
    BAD_CONFIG,
    BAD_ENVIRONMENT,
    Call,
    CniError,
    parse_call,
    policy_name,
    run,
)
from egress.kernel.netns_cgroup import NoCgroup, _outsiders, common

ENV = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "abc", "CNI_NETNS": "/run/netns/x",
       "CNI_IFNAME": "eth0"}  # fmt: skip


def call(config: dict[str, object], **env: str) -> Call:
    return parse_call(
        {**ENV, **env}, json.dumps({"cniVersion": "1.0.0", "name": "n", **config}).encode()
    )


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ("K8S_POD_NAMESPACE=agents;K8S_POD_NAME=coder-1", "coder"),
        ("K8S_POD_NAMESPACE=agents;K8S_POD_NAME=other", "agents"),
        ("K8S_POD_NAMESPACE=default;K8S_POD_NAME=coder-1", "fallback"),
        ("", "fallback"),  # not a pod: the default only
        ("IgnoreUnknown=1; K8S_POD_NAMESPACE = agents ;K8S_POD_NAME=coder-2", "coder"),
    ],
)
def test_the_first_matching_mapping_entry_wins(args: str, want: str) -> None:
    mapping = [{"namespace": "agents", "pod": "coder-*", "policy": "coder"},
               {"namespace": "agents", "policy": "agents"}]  # fmt: skip
    c = call({"mapping": mapping, "policy": "fallback"}, CNI_ARGS=args)
    assert policy_name(c) == want


def test_mapping_entries_may_match_the_pods_annotations_as_the_runtime_passes_them() -> None:
    """containerd and CRI-O fill runtimeConfig's io.kubernetes.cri.pod-annotations for a
    plugin whose entry declares that capability; no labels are passed."""
    mapping = [{"namespace": "agents", "annotations": {"egress.io/role": "pip-*"},
                "policy": "python-dev"},
               {"namespace": "agents", "policy": "llm-api-only"}]  # fmt: skip
    pod = "K8S_POD_NAMESPACE=agents;K8S_POD_NAME=coder-1"

    def chosen(notes: dict[str, str] | None) -> str | None:
        config: dict[str, object] = {"mapping": mapping}
        if notes is not None:
            config["runtimeConfig"] = {"io.kubernetes.cri.pod-annotations": notes}
        return policy_name(call(config, CNI_ARGS=pod))

    assert chosen({"egress.io/role": "pip-builder", "other": "x"}) == "python-dev"
    assert chosen({"egress.io/role": "web"}) == "llm-api-only"
    assert chosen({}) == "llm-api-only"
    assert chosen(None) == "llm-api-only"  # the runtime passed none: no annotation matches
    with pytest.raises(CniError, match="annotations must map keys to globs"):
        policy_name(call({"mapping": [{"annotations": ["x"], "policy": "p"}]}, CNI_ARGS=pod))


def test_no_policy_for_a_pod_is_a_config_error_naming_it() -> None:
    c = call({"mapping": [{"namespace": "x", "policy": "p"}]},
             CNI_ARGS="K8S_POD_NAMESPACE=a;K8S_POD_NAME=b")  # fmt: skip
    with pytest.raises(CniError) as err:
        policy_name(c)
    assert err.value.code == BAD_CONFIG and "pod a/b" in err.value.msg


def test_an_unknown_mapping_key_is_refused() -> None:
    c = call({"mapping": [{"namespace": "x", "labels": {}, "policy": "p"}], "policy": "d"},
             CNI_ARGS="K8S_POD_NAMESPACE=x;K8S_POD_NAME=y")  # fmt: skip
    with pytest.raises(CniError, match="unknown key 'labels'"):
        policy_name(c)


def test_del_needs_no_netns_but_add_and_check_do() -> None:
    for command in ("ADD", "CHECK"):
        with pytest.raises(CniError) as err:
            call({}, CNI_COMMAND=command, CNI_NETNS="")
        assert err.value.code == BAD_ENVIRONMENT
    assert call({}, CNI_COMMAND="DEL", CNI_NETNS="").netns == ""


def test_errors_carry_the_configs_version_and_the_code_as_exit_status() -> None:
    code, out = run({**ENV, "CNI_COMMAND": "ADD"}, b'{"cniVersion": "0.4.0", "name": "n"}')
    assert code == 7 and out is not None  # no prevResult: a chained plugin's config error
    assert sorted(out) == ["cniVersion", "code", "details", "msg"]
    assert (out["cniVersion"], out["code"]) == ("0.4.0", 7) and "chained" in out["msg"]


@pytest.mark.parametrize(
    ("paths", "want"),
    [
        (["/kubepods/pod1/c1", "/kubepods/pod1/c2"], "/kubepods/pod1"),
        (["/libpod_parent/libpod-a"], "/libpod_parent/libpod-a"),
        (["/a/b", "/a/bc"], "/a"),  # by whole names, not characters
        (["/a/b", "/c"], "/"),
        (["/", "/a"], "/"),
    ],
)
def test_common_is_the_deepest_cgroup_holding_all(paths: list[str], want: str) -> None:
    assert common(paths) == want


def test_a_netns_removed_while_its_cgroup_is_looked_for_is_no_cgroup(tmp_path: Path) -> None:
    """A pod torn down while egress looks for its cgroup (a freeze's look again): its netns
    gone is NoCgroup, which a bind keeps its binding through, not an OSError that would
    end the writer that looks."""
    with pytest.raises(NoCgroup, match=r"netns .*gone: No such file"):
        _outsiders(str(tmp_path), set(), str(tmp_path / "gone"))


def test_unmatched_pass_leaves_a_pod_no_rule_names_alone() -> None:
    mapping = [{"namespace": "agents", "policy": "agents"}]
    c = call({"mapping": mapping, "unmatched": "pass"},
             CNI_ARGS="K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-1")  # fmt: skip
    assert policy_name(c) is None
    c = call({"mapping": mapping, "unmatched": "pass"},
             CNI_ARGS="K8S_POD_NAMESPACE=agents;K8S_POD_NAME=a")  # fmt: skip
    assert policy_name(c) == "agents"
    with pytest.raises(CniError, match="unmatched must be"):
        policy_name(call({"unmatched": "allow"}))
    code, out = run({**ENV, "CNI_COMMAND": "ADD"}, json.dumps({
        "cniVersion": "1.0.0", "name": "n", "unmatched": "pass",
        "prevResult": {"cniVersion": "1.0.0", "ips": []}}).encode())  # fmt: skip
    assert (code, out) == (0, {"cniVersion": "1.0.0", "ips": []})  # no egressd asked


@pytest.mark.parametrize("name", ["a:b", "", "-x", "a b"])
def test_a_network_name_the_spec_refuses_is_a_config_error(name: str) -> None:
    with pytest.raises(CniError) as err:
        parse_call(ENV, json.dumps({"cniVersion": "1.0.0", "name": name}).encode())
    assert err.value.code == BAD_CONFIG
