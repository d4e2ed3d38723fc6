"""What needs no running Serve: the router's prefix table, an engine's bundles, the builder's checks."""

from __future__ import annotations

import pytest

from cluster.config import EngineConfig
from cluster.core.placement import WorkerResources, borrowed_bundles
from cluster.serve.deployments import build_app, engine_bundles, engine_config_for_serve
from cluster.serve.prefix_router import PrefixTable, prompt_blocks, request_prompt


def test_prompt_blocks_chain_full_blocks_only():
    a = prompt_blocks(list(range(40)), block_size=16)
    assert len(a) == 2  # the partial third block is not a block
    b = prompt_blocks(list(range(32)) + [7] * 16, block_size=16)
    assert b[:2] == a and len(b) == 3
    c = prompt_blocks([99] + list(range(1, 40)), block_size=16)
    assert c[0] != a[0] and c[1] != a[1]  # chained: a different first block changes every later hash
    assert len(prompt_blocks("x" * 130, chars_per_block=64)) == 2


def test_table_matches_the_longest_leading_run():
    t = PrefixTable()
    shared = prompt_blocks(list(range(64)))
    t.record("e1", shared[:2])
    t.record("e2", shared)
    assert t.matched("e1", shared) == 2 and t.matched("e2", shared) == 4
    assert t.best(["e1", "e2", "e3"], shared) == (["e2"], 4)
    assert t.best(["e1", "e3"], shared) == (["e1"], 2)
    assert t.best(["e3"], shared) == ([], 0)
    other = prompt_blocks(list(range(100, 164)))
    assert t.best(["e1", "e2"], other) == ([], 0)


def test_table_forgets_oldest_blocks_and_gone_engines():
    t = PrefixTable(max_blocks_per_engine=4)
    old, new = prompt_blocks(list(range(64))), prompt_blocks(list(range(1000, 1064)))
    t.record("e", old)
    t.record("e", new)
    assert t.matched("e", old) == 0 and t.matched("e", new) == 4
    t.record("f", old)
    t.keep_only(["e"])
    assert t.matched("f", old) == 0
    t.forget("e")
    assert t.matched("e", new) == 0


def test_request_prompt_reads_the_engine_calls_argument():
    class Pending:
        def __init__(self, *args):
            self.args = args

    assert request_prompt(Pending(["id", [1, 2, 3], None, None])) == [1, 2, 3]
    assert request_prompt(Pending(["id", "text", {}, "g"])) == "text"
    assert request_prompt(Pending()) is None and request_prompt(None) is None
    assert request_prompt(Pending("not a request")) is None


def test_an_engine_asks_a_bundle_per_rank():
    cfg = engine_config_for_serve(EngineConfig(device="cpu", accelerator_resource="NPU", tensor_parallel_size=2,
                                               num_replicas=2))
    assert cfg.threads_per_worker == 1  # fixed: an engine cannot split cores with engines not started yet
    assert engine_bundles(cfg) == [{"CPU": 1.0, "NPU": 1.0}] * 4
    fake = engine_config_for_serve(EngineConfig(fake_step_s=0.01))
    assert engine_bundles(fake) == [{"CPU": 0.01}]
    given = engine_config_for_serve(EngineConfig(threads_per_worker=3))
    assert engine_bundles(given) == [{"CPU": 3.0}]


def test_borrowed_bundles_place_ranks_in_order_or_say_why_not():
    need = WorkerResources(num_cpus=1, accelerator="NPU")
    places = borrowed_bundles([{"CPU": 1, "NPU": 1}] * 4, need, num_replicas=2, ranks=2)
    assert [(p.first_bundle, p.owned) for p in places] == [(0, False), (2, False)]
    with pytest.raises(ValueError, match=r"need 4 bundle\(s\)"):
        borrowed_bundles([{"CPU": 1, "NPU": 1}] * 3, need, num_replicas=2, ranks=2)
    with pytest.raises(ValueError, match=r"bundle\(s\) \[1\] do not"):
        borrowed_bundles([{"CPU": 1, "NPU": 1}, {"CPU": 1}], need, num_replicas=1, ranks=2)


def test_build_app_names_bad_options():
    with pytest.raises(ValueError, match="num_engines must be an integer >= 1, got 0"):
        build_app({"num_engines": "0"})
    with pytest.raises(ValueError, match=r"unknown config option\(s\) \['max_num_seq'\]"):
        build_app({"max_num_seq": "8"})
    with pytest.raises(ValueError, match="max_num_seqs"):
        build_app({"max_num_seqs": "-1"})
    with pytest.raises(ValueError, match="autoscaling_config must be a mapping"):
        build_app({"autoscaling_config": "lots"})
    with pytest.raises(ValueError, match="stream_interval_ms must be"):
        build_app({"stream_interval_ms": "-5"})
    with pytest.raises(ValueError, match="ingress must be one of deployment, direct, got 'proxy'"):
        build_app({"ingress": "proxy"})


def test_the_serve_config_file_builds_its_application():
    """deploy/serve.yaml's application, as `serve run` builds it (its import_path with its args)."""
    from pathlib import Path

    import yaml
    from ray.serve import Application

    import cluster.serve.deployments as deployments

    config = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "serve.yaml").read_text())
    (app,) = config["applications"]
    module, name = app["import_path"].split(":")
    assert module == deployments.__name__
    assert isinstance(getattr(deployments, name)(app["args"]), Application)
    names = {d["name"] for d in app["deployments"]}
    assert names == {deployments.ENGINE_DEPLOYMENT, deployments.INGRESS_DEPLOYMENT}
    engine = engine_config_for_serve({k: v for k, v in app["args"].items() if k in EngineConfig.__dataclass_fields__})
    assert engine_bundles(engine) == [{"CPU": 1.0, "NPU": 1.0}] * 2  # TP 2: two NPUs per engine
