"""`raylm bench`: raylm against its peers on seeded random requests. A subpackage the CLI
registers (cluster/cli.py); nothing else in the product imports it.

    command.py      the `raylm bench` arguments and the run they start
    suite.py        the runs of one invocation: plan, rounds, the serving sweep
    workload.py     seeded random prompts and output lengths
    contenders.py   raylm through the engine, and the bare ModelRunner + Scheduler loop
    hf_runs.py      HF transformers on the same weight tensors
    vllm_peer.py    vLLM's CPU build in a subprocess (its own venv) on the same checkpoint
    figures.py      throughput, latency percentiles, output agreement
    report.py       ratios, targets, the printed table and the JSON
    plot.py         the PNG (matplotlib)
    profiler.py     py-spy over the engine's processes
"""

from cluster.bench.command import add_parser

__all__ = ["add_parser"]
