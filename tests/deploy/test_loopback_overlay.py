"""deploy/loopback-overlay.yaml is the only difference between the Ascend cluster file and
the loopback run (test_loopback_cluster.py): what it changes, and what it may not change.
Fast: renders and parses, starts nothing."""

from __future__ import annotations

import copy
import importlib.util
import shlex
import warnings
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.commands import _bootstrap_config

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # ray.serve's pydantic models warn at import
    from ray.scripts.scripts import start as ray_start_command

CHECKOUT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((CHECKOUT / "deploy" / "ascend-cluster.yaml").read_text())
OVERLAY = yaml.safe_load((CHECKOUT / "deploy" / "loopback-overlay.yaml").read_text())

_spec = importlib.util.spec_from_file_location("deploy_overlay", CHECKOUT / "deploy" / "overlay.py")
overlay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overlay)

# The `ray start` options the loopback commands may change, each for a reason given in the
# overlay's comments; everything else (resources, --head, --port, the autoscaling config)
# must stay as shipped.
LOOPBACK_ONLY = {"node_ip_address", "dashboard_host", "dashboard_port", "ray_client_server_port",
                 "dashboard_agent_listen_port", "dashboard_agent_grpc_port", "metrics_export_port",
                 "runtime_env_agent_port", "object_store_memory"}


def render(**sets) -> dict:
    return overlay.render(BASE, OVERLAY, {"ssh_key": "/tmp/key", **sets})


def ray_start(command: str) -> dict:
    """Options of the `ray start` ending a `a && b && ray start ...` line, via Ray's parser."""
    words = shlex.split(command)
    i = max(j for j in range(len(words) - 1) if words[j:j + 2] == ["ray", "start"])
    return ray_start_command.make_context("ray start", words[i + 2:]).params


def test_rendered_loopback_config_passes_ray_up_validation():
    config = _bootstrap_config(copy.deepcopy(render()), no_config_cache=True)
    provider = config["provider"]
    assert (provider["type"], provider["head_ip"], provider["worker_ips"]) == ("local", "127.0.0.1", ["127.0.0.2"])
    assert config["auth"]["ssh_private_key"] == "/tmp/key"
    assert any(f"-e {CHECKOUT}" in c for c in config["head_setup_commands"])  # raylm from this checkout
    assert not any("raylm[npu]" in c for c in config["worker_setup_commands"])  # not from the index


def test_only_the_overlay_keys_differ_from_the_shipped_file():
    rendered = render()
    changed = {k for k in rendered if rendered.get(k) != BASE.get(k)}
    assert changed <= set(OVERLAY) - {"placeholders"}
    assert set(rendered) == set(BASE)  # nothing added, nothing dropped
    assert rendered["provider"]["type"] == BASE["provider"]["type"]  # mappings merge
    for key in ("file_mounts", "head_setup_commands", "worker_setup_commands", "idle_timeout_minutes"):
        assert rendered[key] == BASE[key]


@pytest.mark.parametrize("key", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_loopback_ray_start_keeps_the_shipped_options_and_the_npu_declaration(key):
    shipped = ray_start(BASE[key][-1])
    loopback = ray_start(render()[key][-1])
    differ = {k for k in shipped if shipped[k] != loopback[k]}
    assert differ <= LOOPBACK_ONLY, differ - LOOPBACK_ONLY
    assert loopback["resources"] == shipped["resources"] == '{"NPU": 8}'
    assert loopback["node_ip_address"] in ("127.0.0.1", "127.0.0.2")
    assert loopback["dashboard_host"] in (None, "127.0.0.1")  # nothing beyond loopback
    # One machine holds both nodes: a `ray stop` would kill the other node's Ray too.
    assert not any(c.strip() == "ray stop" for c in render()[key])


def test_placeholders_fill_from_defaults_then_sets():
    rendered = render(gcs_port="36379", cluster_name="x")
    assert rendered["cluster_name"] == "x"
    assert ray_start(rendered["head_start_ray_commands"][-1])["port"] == 36379
    assert "$RAY_HEAD_IP:36379" in rendered["worker_start_ray_commands"][-1]  # shell variables stay
    assert f"{CHECKOUT}/.venv/bin/activate" in rendered["head_start_ray_commands"][-1]  # nested default


def test_an_unknown_set_or_placeholder_is_an_error_naming_it():
    with pytest.raises(ValueError, match="gsc_port"):
        render(gsc_port="1")
    bad = dict(OVERLAY, min_workers="{{nodes}}")
    with pytest.raises(ValueError, match=r"\{\{nodes\}\}"):
        overlay.render(BASE, bad, {})


def test_merge_merges_mappings_and_replaces_everything_else():
    base = {"a": {"x": 1, "y": [1, 2]}, "b": [1], "c": 3}
    out = overlay.merge(base, {"a": {"y": [9]}, "b": [2, 3]})
    assert out == {"a": {"x": 1, "y": [9]}, "b": [2, 3], "c": 3}
    assert base == {"a": {"x": 1, "y": [1, 2]}, "b": [1], "c": 3}  # the base is not modified


def test_overlay_cli_writes_the_rendered_yaml(tmp_path):
    out = tmp_path / "c.yaml"
    assert overlay.main([str(CHECKOUT / "deploy" / "ascend-cluster.yaml"),
                         str(CHECKOUT / "deploy" / "loopback-overlay.yaml"),
                         "--set", "ssh_key=/tmp/key", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == render()
    assert overlay.main([str(tmp_path / "missing.yaml"), str(out)]) == 2
