"""A draft model on the worker: a smaller Qwen3 with the target's vocab, its own paged KV pool
indexed by the target's block tables, drafting k tokens greedily for each verifying row.

The draft computes no prompt while the target prefills: a row about to draft first catches the
draft's KV up from the slot's `draft_computed` to its input token (the whole prompt the first
time, one or two tokens afterwards), in the same pass that drafts the first token; the other k - 1
tokens take one single-token pass each, their inputs the previous pass's argmax on the device.
After verification the draft's KV is valid up to the last position whose input was a true token
(accepted drafts count); what lies beyond is rewritten by the next catch-up. Positions the draft
writes are the target's own (same blocks), so a block shared through the prefix cache is written
only with the K/V of its own tokens, which the request sharing it also computes.
"""

from __future__ import annotations

import torch

from workers.draft_passes import DraftPasses
from workers.kv_cache import KVCache
from workers.loader import cast_model, is_random_spec, load_model, random_model
from workers.models.qwen3 import Qwen3ForCausalLM
from workers.ops.metadata import SequenceRows, build_metadata
from workers.slot_table import RowWork


class DraftModel:
    def __init__(self, path: str, *, ops, dtype: torch.dtype, device: torch.device, vocab_size: int,
                 target_vocab: int) -> None:
        """Loads the draft's weights; its KV pool comes with `allocate`, once the target's block
        count is known (sized with `bytes_per_block` added to the target's)."""
        if is_random_spec(path):
            model = random_model(path, dtype=dtype, device=device)
        else:
            model = load_model(path, dtype=dtype, device=device)
        if model.dtype != dtype:
            model = cast_model(model, dtype, device)
        if model.config.vocab_size != target_vocab:
            raise ValueError(f"speculative_config model {path!r} has vocab_size {model.config.vocab_size}; "
                             f"the target's is {target_vocab}: a draft model must share the tokenizer")
        self.path = path
        self.model: Qwen3ForCausalLM = model.eval()
        self.vocab_size = vocab_size
        with torch.no_grad():
            self.model.prepare(ops, logits_rows=vocab_size, release=True)
        self.device = device
        self.block_size = 0
        self.kv_cache: KVCache | None = None
        self.num_passes = 0

    def bytes_per_block(self, block_size: int) -> int:
        mc = self.model.config
        return KVCache.bytes_per_block(num_layers=mc.num_hidden_layers, block_size=block_size,
                                       num_kv_heads=self.model.shape.num_kv_heads, head_dim=mc.head_dim,
                                       dtype=self.model.dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The draft's KV pool: as many blocks as the target's, indexed by the same block tables."""
        mc = self.model.config
        self.block_size = block_size
        self.kv_cache = KVCache(num_layers=mc.num_hidden_layers, num_blocks=num_blocks, block_size=block_size,
                                num_kv_heads=self.model.shape.num_kv_heads, head_dim=mc.head_dim,
                                dtype=self.model.dtype, device=self.device)

    def propose(self, rows: list[RowWork]) -> None:
        """Sets each row's `draft` to its `lookahead` greedy tokens. Each row's input token (at
        position start) is the last of its state's known tokens."""
        rows = sorted(rows, key=lambda w: w.state.draft_computed < w.start)  # single-token rows first
        ids, positions, seqs, last = [], [], [], []
        for w in rows:
            start = min(w.state.draft_computed, w.start)
            ids += w.state.known_tokens(start, w.start + 1)
            positions += range(start, w.start + 1)
            seqs.append(SequenceRows(start, w.start + 1 - start, w.state.block_table))
            last.append(len(ids) - 1)
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        attn = build_metadata(seqs, num_decode=sum(s.num_tokens == 1 for s in seqs), block_size=self.block_size,
                              device=dev)
        hidden = self._pass(torch.tensor(ids, dtype=torch.int64, device=dev), pos, attn,
                            self.model.rotary(pos, self.model.dtype))
        if len(last) < len(ids):
            hidden = hidden.index_select(0, torch.tensor(last, dtype=torch.int64, device=dev))
        columns = [self._greedy(hidden)]  # [R]
        if max(w.lookahead for w in rows) > 1:  # the other k - 1 drafts: one single-token pass each
            later = DraftPasses(rows, offset=0, block_size=self.block_size, device=dev)
            cos, sin = self.model.rotary(later.positions, self.model.dtype)
            for j, index, pos, attn in later:
                prev = columns[-1] if index is None else columns[-1].index_select(0, index)
                out = self._pass(prev, pos, attn, (later.slice(j, cos), later.slice(j, sin)))
                columns.append(later.scatter(index, self._greedy(out), columns[-1]))
        grid = torch.stack(columns, 1).cpu().tolist()  # [R, k]: the drafts' one host copy
        for w, row in zip(rows, grid):
            w.draft = row[:w.lookahead]

    def _pass(self, input_ids: torch.Tensor, pos: torch.Tensor, attn, rotary) -> torch.Tensor:
        """One forward of the draft over `input_ids` [T] at `pos` -> its hidden states [T, hidden]."""
        hidden = torch.empty(len(input_ids), self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
        self.model.embed(input_ids, out=hidden)
        self.num_passes += 1
        return self.model(hidden, pos, self.kv_cache, attn, rotary=rotary)  # [T, hidden]

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.greedy_ids(hidden, self.vocab_size).to(torch.int64)

    @staticmethod
    def accepted(w: RowWork, num_accepted: int) -> None:
        """After verification: the draft's KV holds true tokens up to the input's position plus the
        accepted drafts it consumed as inputs (it never consumed its last draft)."""
        w.state.draft_computed = w.start + min(num_accepted + 1, w.lookahead)

    def describe(self) -> dict:
        mc = self.model.config
        return {"model": self.path, "layers": mc.num_hidden_layers, "hidden_size": mc.hidden_size,
                "kv_cache_bytes": self.kv_cache.nbytes, "passes": self.num_passes}
