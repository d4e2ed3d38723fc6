"""vLLM as a user would time it offline: one fresh process, `LLM(...)` with vLLM's defaults but for
the dtype and the batch limits every contender gets, warmed up, then every request handed to one
`LLM.generate` call. The check on the bench's
peer harness (cluster/bench/vllm_peer.py): `bench_vllm_bare.py --plain` writes its workload to a
JSON file, runs this script with the peers venv's python, and prints both figures side by side.

    .venv-peers/bin/python benchmarks/vllm_plain.py --checkpoint DIR --workload FILE.json --out OUT.json
        [--dtype float32] [--max-num-seqs 64] [--max-num-batched-tokens 2048]

FILE.json holds {"prompts": [[ids]], "output_lens": [n]}. Writes OUT.json: output tokens per
second, the wall seconds, and each request's output ids. Imports nothing of raylm.
"""

import argparse
import json
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(a.workload) as f:
        wl = json.load(f)
    llm = LLM(model=a.checkpoint, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, seed=0)
    rng = random.Random(1)
    warm = [TokensPrompt(prompt_token_ids=[rng.randrange(1000) for _ in range(24)]) for _ in range(2)]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in wl["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in wl["output_lens"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    with open(a.out, "w") as f:
        json.dump({"output_tok_s": sum(map(len, ids)) / elapsed, "elapsed_s": elapsed, "outputs": ids}, f)


if __name__ == "__main__":
    main()
