"""EAGLE-3 drafting on the worker (speculative decoding's method eagle3).

The head (workers/models/eagle3.py) reads the target's features, so it runs where they are, at
the end of each target step, over what that step made certain (`extend`): for each row of a
request that may speculate, every position whose next token is now known (a prefill chunk's
tokens; a decode row's input token and the drafts accepted after it), its input the next
token's embedding beside the target's three aux hidden states, combined by `fc`. That writes
the head's K/V at those positions (its own pool, indexed by the target's block tables) and
leaves, per slot, the head's output at the last of them, resident: the feature it drafts the
next token from. The next step's `propose` drafts from it without the target: the first draft
from that output, each further one from one single-token head pass over the previous draft at
the next position. Those passes write K/V past the accepted positions; the next `extend`
rewrites every position it keeps. Prefix-cached blocks hold the head's K/V as whoever computed
them wrote it (a request that did not speculate leaves it stale: drafts get worse, never wrong).

Under tensor parallelism every rank runs the whole head on the same all-reduced features, so
all draft alike. Features are taken only in a step that runs the model eagerly (no captured graph).
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qsl

import torch
from safetensors import safe_open

from workers.draft_passes import DraftPasses
from workers.kv_cache import KVCache
from workers.loader import RANDOM_PREFIX, CheckpointError, _weight_files
from workers.models.eagle3 import Eagle3Config, Eagle3Head
from workers.models.qwen3 import Qwen3ForCausalLM
from workers.ops.metadata import SequenceRows, build_metadata
from workers.slot_table import RowWork

RANDOM_HEAD = RANDOM_PREFIX + "eagle3"


def is_random_head(spec) -> bool:
    return isinstance(spec, str) and (spec == RANDOM_HEAD or spec.startswith(RANDOM_HEAD + "?"))


def random_head(spec: str, target: Qwen3ForCausalLM, dtype: torch.dtype, device) -> Eagle3Head:
    """`random:eagle3[?seed=S&draft_vocab=N]`: a head of the target's width with seeded random
    weights (tests: exactness must not depend on the head), a draft vocab of N ids (default: all)
    mapped to a seeded random choice of target ids."""
    opts = dict(parse_qsl(spec.partition("?")[2]))
    unknown = set(opts) - {"seed", "draft_vocab"}
    if unknown or not all(v.isdigit() for v in opts.values()):
        raise ValueError(f"speculative_config model {spec!r}: options are seed and draft_vocab (integers)")
    mc = target.config
    draft_vocab = int(opts.get("draft_vocab", mc.vocab_size))
    config = Eagle3Config(hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                          num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
                          head_dim=mc.head_dim, vocab_size=mc.vocab_size, draft_vocab_size=draft_vocab,
                          target_hidden_size=mc.hidden_size, rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
                          # vLLM's default needs 5 layers; a shallower target gives its first, middle and last
                          aux_layer_ids=None if mc.num_hidden_layers >= 5 else
                          (0, mc.num_hidden_layers // 2, mc.num_hidden_layers - 1))
    config.check()
    gen = torch.Generator().manual_seed(int(opts.get("seed", 0)))
    head = Eagle3Head(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.numel():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        targets = torch.randperm(mc.vocab_size, generator=gen)[:draft_vocab].sort().values
        head.d2t.copy_(targets - torch.arange(draft_vocab))
    return head.to(device=device, dtype=dtype).eval()


def head_config(path: str) -> Eagle3Config:
    d = Path(path)
    if not (d / "config.json").is_file():
        raise CheckpointError(f"speculative_config model {path!r}: no config.json (an EAGLE-3 head directory)")
    return Eagle3Config.from_dict(json.loads((d / "config.json").read_text(encoding="utf-8")))


def check_head(config: Eagle3Config, target: Qwen3ForCausalLM, path: str) -> None:
    """That a head's shape fits the target it drafts for (before its weights are read)."""
    mc = target.config
    if config.vocab_size != mc.vocab_size:
        raise ValueError(f"EAGLE-3 head {path!r} has vocab_size {config.vocab_size}; the target's is {mc.vocab_size}")
    if config.target_hidden_size != mc.hidden_size:
        raise ValueError(f"EAGLE-3 head {path!r} reads features of width {config.target_hidden_size}; the target's "
                         f"hidden_size is {mc.hidden_size}")
    config.layers_for(mc.num_hidden_layers)


def load_head(path: str, dtype: torch.dtype, device) -> Eagle3Head:
    """A head checkpoint directory: config.json and safetensors with the published names."""
    d = Path(path)
    config = head_config(path)
    weights: dict[str, torch.Tensor] = {}
    for file in _weight_files(d):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                key = name.removeprefix("model.").replace("layers.0.", "midlayer.")
                if key != "t2d":
                    weights[key] = f.get_tensor(name)
    head = Eagle3Head(config, own_embedding="embed_tokens.weight" in weights)
    expected = {k: v for k, v in head.state_dict().items() if v.numel() or k != "embed_tokens.weight"}
    if "d2t" not in weights:  # a head over the whole vocab has none
        if config.draft_vocab_size != config.vocab_size:
            raise CheckpointError(f"EAGLE-3 head {path!r} has draft_vocab_size {config.draft_vocab_size} but no d2t")
        weights["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    missing, unknown = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unknown:
        raise CheckpointError(f"EAGLE-3 head {path!r}: missing weights {missing[:5]}, unexpected {unknown[:5]}")
    for name, t in weights.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"EAGLE-3 head {path!r}: {name} has shape {tuple(t.shape)}, the config "
                                  f"gives {tuple(expected[name].shape)}")
    weights["d2t"] = weights["d2t"].to(torch.int64)
    weights.setdefault("embed_tokens.weight", head.embed_tokens.weight)  # none: the target's serves
    head.load_state_dict(weights)
    return head.to(device=device, dtype=dtype).eval() if dtype else head.eval()


class Eagle3Drafter:
    def __init__(self, path: str, *, target: Qwen3ForCausalLM, ops, dtype: torch.dtype, device: torch.device,
                 max_slots: int) -> None:
        if not is_random_head(path):
            check_head(head_config(path), target, path)
        head = random_head(path, target, dtype, device) if is_random_head(path) else load_head(path, dtype, device)
        c, mc = head.config, target.config
        if not head.has_embedding and c.hidden_size != mc.hidden_size:
            raise ValueError(f"EAGLE-3 head {path!r} has hidden_size {c.hidden_size} and no embedding of its own; "
                             f"the target's embedding is {mc.hidden_size} wide")
        bad = int(((head.d2t + torch.arange(c.draft_vocab_size, device=device)) >= mc.vocab_size).sum())
        if bad:
            raise ValueError(f"EAGLE-3 head {path!r}: d2t maps {bad} draft ids past the target's vocab")
        self.path = path
        self.head = head
        self.target = target
        self.aux_layers = c.layers_for(mc.num_hidden_layers)
        with torch.no_grad():
            head.prepare(ops)
        self.device = device
        self.hidden = torch.zeros(max_slots, c.hidden_size, dtype=head.dtype, device=device)  # per slot
        self.position = [-1] * max_slots  # the position whose output `hidden` holds (-1: none)
        self.block_size = 0
        self.kv_cache: KVCache | None = None
        self.num_passes = 0
        self._features: tuple[dict[int, int], list[torch.Tensor]] | None = None

    def bytes_per_block(self, block_size: int) -> int:
        c = self.head.config
        return KVCache.bytes_per_block(num_layers=1, block_size=block_size, num_kv_heads=c.num_key_value_heads,
                                       head_dim=c.head_dim, dtype=self.head.dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        c = self.head.config
        self.block_size = block_size
        self.kv_cache = KVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size,
                                num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.head.dtype,
                                device=self.device)

    def hold(self, row_starts: dict[int, int], aux: list[torch.Tensor]) -> None:
        """The step's aux hidden states [T, target hidden] each, and where each slot's row begins
        in the flat batch: kept for `extend`, once the step's tokens are known."""
        self._features = row_starts, aux

    def extend(self, rows: list[RowWork], known_before: dict[int, int]) -> None:
        """After the step's tokens are recorded: run the head over each row's positions
        whose next token is known. known_before: each slot's count of known tokens before the step
        (a decode row's input must have been among them)."""
        held, self._features = self._features, None
        if held is None:
            return
        row_starts, aux = held
        work = []
        for w in rows:
            if w.slot not in row_starts:
                continue
            if w.is_decode and known_before.get(w.slot) != w.start + 1:
                continue  # its input token is not known here: nothing to extend from
            known = len(w.state.token_ids) + len(w.state.generated)
            n = min(w.num_tokens, known - 1 - w.start)
            if n > 0:
                work.append((w, n))
        if not work:
            return
        work.sort(key=lambda x: x[1] > 1)  # single-position rows first: attention's decode rows
        index, ids, positions, seqs, last = [], [], [], [], []
        for w, n in work:
            first = row_starts[w.slot]
            index += range(first, first + n)
            ids += w.state.known_tokens(w.start + 1, w.start + n + 1)
            positions += range(w.start, w.start + n)
            seqs.append(SequenceRows(w.start, n, w.state.block_table))
            last.append(len(index) - 1)
        dev = self.device
        rows_t = torch.tensor(index, dtype=torch.int64, device=dev)
        features = torch.cat([a.index_select(0, rows_t) for a in aux], dim=-1)  # [N, 3 x target hidden]
        hidden = self.head.combine(features.to(self.head.dtype))
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        attn = build_metadata(seqs, num_decode=sum(n == 1 for _, n in work), block_size=self.block_size, device=dev)
        out = self._pass(torch.tensor(ids, dtype=torch.int64, device=dev), hidden, pos, attn, self.head.rotary(pos))
        slots = torch.tensor([w.slot for w, _ in work], dtype=torch.int64, device=dev)
        self.hidden.index_copy_(0, slots, out.index_select(0, torch.tensor(last, dtype=torch.int64, device=dev)))
        for w, n in work:
            self.position[w.slot] = w.start + n - 1

    def propose(self, rows: list[RowWork]) -> None:
        """Sets each row's `draft` to its `lookahead` greedy tokens, where the head's output at the
        position before the row's input is resident (else no drafts)."""
        rows = [w for w in rows if self.position[w.slot] == w.start - 1]
        if not rows:
            return
        dev = self.device
        slots = torch.tensor([w.slot for w in rows], dtype=torch.int64, device=dev)
        hidden = self.hidden.index_select(0, slots)  # [R, hidden]: each row's latest head output
        columns = [self.head.greedy_ids(hidden)]
        if max(w.lookahead for w in rows) > 1:  # each further draft: one head pass a row
            later = DraftPasses(rows, offset=-1, block_size=self.block_size, device=dev)
            cos, sin = self.head.rotary(later.positions)
            for j, index, pos, attn in later:
                prev, before = (columns[-1], hidden) if index is None else \
                    (columns[-1].index_select(0, index), hidden.index_select(0, index))
                out = self._pass(prev, before, pos, attn, (later.slice(j, cos), later.slice(j, sin)))
                hidden = out if index is None else hidden.index_copy(0, index, out)
                columns.append(later.scatter(index, self.head.greedy_ids(out), columns[-1]))
        grid = torch.stack(columns, 1).cpu().tolist()  # [R, k]: the drafts' one host copy
        for w, row in zip(rows, grid):
            w.draft = row[:w.lookahead]

    def _pass(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, attn, rotary) -> torch.Tensor:
        embeds = torch.empty(len(ids), self.head.config.hidden_size, dtype=self.head.dtype, device=self.device)
        if self.head.has_embedding:
            torch.index_select(self.head.embed_tokens.weight, 0, ids, out=embeds)
        else:
            self.target.embed(ids, out=embeds)
        self.num_passes += 1
        return self.head(embeds, hidden, pos, self.kv_cache, attn, rotary)

    def release(self, slot: int) -> None:
        self.position[slot] = -1

    def describe(self) -> dict:
        c = self.head.config
        return {"model": self.path, "aux_layers": list(self.aux_layers), "draft_vocab_size": c.draft_vocab_size,
                "kv_cache_bytes": self.kv_cache.nbytes, "passes": self.num_passes}
