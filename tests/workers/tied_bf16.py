"""The bundled tiny model (tied embedding) saved as a bf16 checkpoint, and runners over it: the case of
an lm_head whose prepared copy serves the embedding's lookups too."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def save_tied_bf16(path: Path) -> int:
    """Write the bundled model in bf16 (with its tokenizer) to path; returns the safetensors' bytes."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from workers.loader import bundled_model_path

    src = bundled_model_path()
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    assert hf.config.tie_word_embeddings
    hf.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{f}", path / f)
    return sum(t.nbytes for t in load_file(str(path / "model.safetensors")).values())


def tied_runner(path: Path, ops: str, dtype: str):
    from workers.runner import ModelRunner
    from workers.runner_config import RunnerConfig

    return ModelRunner(RunnerConfig(model=str(path), ops=ops, dtype=dtype, block_size=4, num_kv_blocks=64,
                                    max_num_seqs=4))
