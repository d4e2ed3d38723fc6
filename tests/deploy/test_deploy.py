"""deploy/ascend-cluster.yaml goes through the same preparation and validation that
`ray up` applies (ray.autoscaler._private.commands._bootstrap_config: the local
provider's prepare_local, Ray's defaults, the ray-schema.json check), and its start
commands parse with Ray's own `ray start` option parser. Nothing here starts Ray,
opens SSH, or touches the network."""

from __future__ import annotations

import copy
import shlex
import warnings
from pathlib import Path

import click
import jsonschema
import pytest
import yaml
from ray._private.utils import parse_resources_json
from ray.autoscaler._private.cli_logger import cf, cli_logger
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.local.config import LOCAL_CLUSTER_NODE_TYPE

with warnings.catch_warnings():
    # Ray's CLI module imports ray.serve, whose pydantic models warn at import time.
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray.scripts.scripts import start as ray_start_command

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "deploy" / "ascend-cluster.yaml"


def load_config() -> dict:
    with open(CLUSTER_YAML) as f:
        return yaml.safe_load(f)  # what `ray up` uses to read the file


def bootstrap(config: dict) -> dict:
    """What `ray up` does with the loaded YAML before any SSH. No cache file is read or
    written, so every call validates afresh."""
    return _bootstrap_config(copy.deepcopy(config), no_config_cache=True)


def ray_start_options(command: str) -> dict:
    """The `ray start ...` at the end of a `a && b && ray start ...` line, split as a
    POSIX shell splits words, then parsed (not run) by Ray's click command."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token == "&&":
            segments.append([])
        else:
            segments[-1].append(token)
    last = segments[-1]
    assert last[:2] == ["ray", "start"], f"the command does not end in `ray start`: {command!r}"
    ctx = ray_start_command.make_context("ray start", last[2:])
    return ctx.params


def test_shipped_yaml_passes_ray_up_validation():
    raw = load_config()
    config = bootstrap(raw)

    assert config["provider"]["type"] == "local"
    assert isinstance(config["provider"]["worker_ips"], list)
    # The local provider made its single node type, with every worker IP in use.
    assert config["head_node_type"] == LOCAL_CLUSTER_NODE_TYPE
    node_type = config["available_node_types"][LOCAL_CLUSTER_NODE_TYPE]
    num_workers = len(raw["provider"]["worker_ips"])
    assert node_type["min_workers"] == node_type["max_workers"] == num_workers
    assert config["max_workers"] == num_workers
    # setup_commands were merged ahead of the head/worker specific ones.
    assert config["head_setup_commands"][: len(raw["setup_commands"])] == raw["setup_commands"]
    assert config["worker_setup_commands"][: len(raw["setup_commands"])] == raw["setup_commands"]
    assert any('pip install -U "raylm[npu]"' in c for c in config["worker_setup_commands"])
    # Our start commands survive preparation unchanged (defaults did not replace them).
    assert config["head_start_ray_commands"] == raw["head_start_ray_commands"]
    assert config["worker_start_ray_commands"] == raw["worker_start_ray_commands"]


@pytest.mark.parametrize("key", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_start_commands_declare_eight_npus(key):
    commands = load_config()[key]
    assert all(isinstance(c, str) for c in commands)  # YAML kept every line a string
    assert commands[0] == "ray stop"
    start = commands[-1]
    assert "--resources='{\"NPU\": 8}'" in start
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in start

    options = ray_start_options(start)
    assert options["resources"] == '{"NPU": 8}'
    assert parse_resources_json(options["resources"], cli_logger, cf) == {"NPU": 8}
    if key == "head_start_ray_commands":
        assert options["head"] is True
        assert options["port"] == 6379
        assert options["dashboard_host"] == "0.0.0.0"
        assert options["autoscaling_config"] == "~/ray_bootstrap_config.yaml"
    else:
        assert options["head"] is False
        assert options["address"] == "$RAY_HEAD_IP:6379"


def test_start_commands_export_the_collective_nic_settings():
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        words = shlex.split(load_config()[key][-1])
        assert any(w.startswith("GLOO_SOCKET_IFNAME=") for w in words)
        assert any(w.startswith("HCCL_IF_IP=") for w in words)


def test_unknown_top_level_key_is_rejected():
    config = load_config()
    config["npus_per_node"] = 8
    with pytest.raises(jsonschema.ValidationError) as info:
        bootstrap(config)
    assert "npus_per_node" in info.value.message


def test_worker_ips_as_a_string_is_rejected():
    config = load_config()
    config["provider"]["worker_ips"] = "192.0.2.11,192.0.2.12"
    with pytest.raises(jsonschema.ValidationError) as info:
        bootstrap(config)
    assert list(info.value.path) == ["provider", "worker_ips"]
    assert info.value.validator == "type"


def test_available_node_types_is_rejected_by_the_local_provider():
    config = load_config()
    config["head_node_type"] = "ascend"
    config["available_node_types"] = {
        "ascend": {"node_config": {}, "resources": {"NPU": 8}, "min_workers": 0, "max_workers": 2}
    }
    with pytest.raises(click.ClickException, match="available_node_types is not supported"):
        bootstrap(config)


def test_missing_worker_ips_is_rejected_by_the_local_provider():
    config = load_config()
    del config["provider"]["worker_ips"]
    with pytest.raises(click.ClickException, match="worker_ips"):
        bootstrap(config)
