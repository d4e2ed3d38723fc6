"""`python -m tests.tp_four_npus`: its own local Ray with four faked NPUs, an engine of
2 replicas x TP 2 on them, greedy outputs for the prompts on stdin (one JSON list of
token-id lists); prints one JSON object: every rank's placement and the outputs. The
shared test Ray has two NPUs, so this runs in a process of its own."""

from __future__ import annotations

import json
import logging
import sys


def main() -> None:
    import ray

    import cluster
    from cluster import SamplingParams

    prompts, max_tokens = json.loads(sys.stdin.read())
    ray.init(num_cpus=4, resources={"NPU": 4}, include_dashboard=False, logging_level=logging.ERROR)
    try:
        with cluster.launch(num_replicas=2, tensor_parallel_size=2, accelerator_resource="NPU", num_kv_blocks=32,
                            threads_per_worker=1) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            stats = llm.stats()
        ranks = [[{"visible": r["visible_devices"]["ASCEND_RT_VISIBLE_DEVICES"], "node": r["node_id"]}
                  for r in rep["info"]["ranks"]] for rep in stats["replicas"]]
        steps = [rep["steps_returned"] for rep in stats["replicas"]]
        print(json.dumps({"ranks": ranks, "steps": steps, "outputs": [o.token_ids for o in outs]}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
