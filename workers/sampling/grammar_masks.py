"""GrammarMasks: structured output on the worker, next to each request.

A request with a grammar (WorkerSampling.grammar) gets a RequestGrammar in its SlotState:
an xgrammar matcher, built when the request's first row samples and then advanced with
the tokens this worker samples for it. Each step, before sampling, `mask` fills the token
bitmask of the sampling rows that have a grammar and sets their disallowed logits to -inf
in place; after sampling, `accept` advances those matchers with the sampled ids. So the
driver's pipelining is untouched (a USE_RESIDENT row needs nothing from the driver) and
nothing but the spec, once, crosses the wire.

A decode row verifying drafts (speculative decoding) samples each of its positions as a row of
its own: `mask_verified` masks position j with the grammar's state after the row's first j
drafts (accepted into the matcher, then rolled back), so a draft the grammar refuses is never
kept, and `accept_run` advances the matcher with the tokens the row kept.

The same masking serves host-logits mode: the worker masks the logits it returns, and
advances each matcher with a decode row's input token (the id the driver sampled) when it
arrives. A matcher is built from the request's known tokens: after a preemption or a
worker restart the request arrives again with its outputs so far, which are replayed
from `grammar_start`. When a matcher has terminated (it accepted a stop token) or rejects
a token (a sampled id the mask allowed cannot be refused; it happens only when a min_tokens
ban left nothing the grammar allows), its request is no longer constrained.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from scheduler.protocol import USE_RESIDENT
from workers.loader import eos_token_ids, load_tokenizer
from workers.sampling.grammar import GrammarCompilerCache, xgrammar_installed
from workers.slot_table import RowWork

log = logging.getLogger(__name__)


@dataclass
class RequestGrammar:
    matcher: object  # xgrammar.GrammarMatcher
    next_position: int  # sequence position of the next token the matcher expects
    active: bool = True

    def accept(self, token: int, position: int) -> None:
        if not self.active or position != self.next_position:
            return
        self.next_position += 1
        if not self.matcher.accept_token(int(token)):
            log.warning("grammar matcher rejected token %d at position %d; the request is unconstrained from "
                        "here", token, position)
            self.active = False
        elif self.matcher.is_terminated():  # it accepted a stop token: the request ends here
            self.active = False


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """logits [B, V] in place: -inf where `bitmask` ([G, ceil(V'/32)] int32, V' >= V, on the
    logits' device; bit j % 32 of word j // 32 set = token j allowed) clears a bit, in the
    rows `rows` ([G] int64; None: every row, G = B)."""
    V = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :V].bool()  # [G, V]
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


class GrammarMasks:
    """Per worker: the compiled-grammar cache (built on first use) and the bitmask buffer."""

    def __init__(self, *, max_num_seqs: int, vocab_size: int, device: torch.device, checkpoint: str | None,
                 max_lookahead: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_rows = max_num_seqs * (1 + max_lookahead)  # rows masked in a step: every verified position
        self.vocab_size = vocab_size  # the model's (the bitmask's width); logits may be narrower
        self.device = torch.device(device)
        self.checkpoint = checkpoint  # its tokenizer and EOS ids; None: a model without a tokenizer
        self.cache: GrammarCompilerCache | None = None
        self._bitmask: torch.Tensor | None = None  # [max_rows, ceil(V/32)] int32, on the host
        self._build_lock = threading.Lock()  # the step thread and a prefetch may both build the compiler
        self.num_prefetches = 0  # prefetch() calls (the engine sends each grammar ahead of its step)

    def _compiler(self) -> GrammarCompilerCache:
        if self.cache is not None:
            return self.cache
        with self._build_lock:
            return self._build_compiler()

    def _build_compiler(self) -> GrammarCompilerCache:
        if self.cache is None:
            if self.checkpoint is None:
                raise ValueError("structured output needs the model's tokenizer, and this model has none")
            tokenizer = load_tokenizer(self.checkpoint)
            # a finished grammar allows only these: the request then ends as at any EOS
            stop_ids = eos_token_ids(self.checkpoint, tokenizer)
            self.cache = GrammarCompilerCache(tokenizer, self.vocab_size, stop_ids)
            bitmask = self.cache.xgr.allocate_token_bitmask(self.max_rows, self.vocab_size)
            self._bitmask = bitmask.pin_memory() if self.device.type != "cpu" else bitmask
        return self.cache

    def prepare(self) -> bool:
        """Build the compiler now (the tokenizer, xgrammar, its TokenizerInfo), not in the step of
        the first request with a grammar; whether it is ready. Nothing to do without a tokenizer or
        without xgrammar; a failure is logged and left to that first request to report."""
        if self.checkpoint is None or not xgrammar_installed():
            return False
        t0 = time.perf_counter()
        try:
            self._compiler()
        except Exception as e:  # e.g. a tokenizer xgrammar cannot read: the first grammar says so
            log.warning("structured output not prepared at start: %s: %s", type(e).__name__, e)
            return False
        log.info("structured output prepared in %.2f s", time.perf_counter() - t0)
        return True

    def prefetch(self, spec) -> str | None:
        """Compile `spec` ahead of the step that admits its request (which then finds it cached),
        building the compiler first if need be; None once compiled, else why it cannot be (the
        driver refuses the request with that reason). Runs beside the steps, never in one."""
        self.num_prefetches += 1
        try:
            self._compiler().compiled(spec)
        except ValueError as e:  # an invalid spec, no tokenizer, no xgrammar: the request's own fault
            return str(e)
        return None

    def stats(self) -> dict:
        return {"ready": self.cache is not None, "compiled": 0 if self.cache is None else self.cache.num_compiled,
                "prefetches": self.num_prefetches}

    def check_new(self, new_requests) -> None:
        """Compile (or find cached) each arriving request's grammar: a ValueError here comes
        before the plan changes anything."""
        for req in new_requests:
            if req.sampling.grammar is not None:
                try:
                    self._compiler().compiled(req.sampling.grammar)
                except ValueError as e:
                    raise ValueError(f"new request for slot {req.slot}: {e}") from None

    @staticmethod
    def any_grammar(work: list[RowWork]) -> bool:
        """Whether a row of `work` has a grammar (its logits must be masked before sampling)."""
        return any(w.state.sampling.grammar is not None for w in work)

    def mask(self, logits: torch.Tensor, work: list[RowWork]) -> None:
        """logits [B, V] of the sampling rows `work` (in order): mask each constrained row."""
        rows = []
        for i, w in enumerate(work):
            g = self._grammar(w)
            if g is not None and g.active:
                rows.append((i, g))
        if not rows:
            return
        bitmask = self._bitmask
        for j, (_, g) in enumerate(rows):
            g.matcher.fill_next_token_bitmask(bitmask, j)
        self._apply(logits, len(rows), None if len(rows) == len(work) else [i for i, _ in rows])

    def _apply(self, logits: torch.Tensor, n: int, index: list[int] | None) -> None:
        bits = self._bitmask[:n]
        if self.device.type != "cpu":
            bits = bits.to(self.device, non_blocking=True)  # pinned; the step's result copy waits for it
        apply_bitmask(logits, bits, None if index is None else torch.tensor(index, device=self.device))

    def mask_verified(self, logits: torch.Tensor, work: list[RowWork]) -> None:
        """logits [V, vocab] of verifying rows' positions (row after row: its input token's, then
        each draft's): a constrained row's position j masked by its grammar after the row's first
        j drafts. Past a draft the grammar refuses (or a finished grammar) nothing is masked: no
        later draft of that row can be kept."""
        index: list[int] = []
        first = 0
        for w in work:
            g = self._grammar(w)
            if g is not None and g.active:
                m, taken = g.matcher, 0
                for j in range(len(w.draft) + 1):
                    if m.is_terminated():
                        break
                    m.fill_next_token_bitmask(self._bitmask, len(index))
                    index.append(first + j)
                    if j == len(w.draft) or not m.accept_token(int(w.draft[j])):
                        break
                    taken += 1
                if taken:
                    m.rollback(taken)
            first += len(w.draft) + 1
        if index:
            self._apply(logits, len(index), index)

    def accept(self, work: list[RowWork], ids) -> None:
        """Advance the matchers of the rows `work` with their sampled ids (device sampling):
        any sequence of ints, e.g. the step's host copy as a numpy array."""
        for w, token in zip(work, ids):
            g = w.state.grammar
            if g is not None:
                g.accept(token, w.sample_position)

    @staticmethod
    def accept_run(w: RowWork, run: list[int]) -> None:
        """Advance a verifying row's matcher with the tokens it kept (its accepted drafts and the
        token after them)."""
        g = w.state.grammar
        if g is not None:
            for j, token in enumerate(run):
                g.accept(token, w.sample_position + j)

    def _grammar(self, w: RowWork) -> RequestGrammar | None:
        """The row's matcher, caught up to the token this row samples; None without a grammar."""
        state = w.state
        spec = state.sampling.grammar
        if spec is None:
            return None
        g = state.grammar
        if g is None:  # first sampling row of this admission: replay the outputs it arrived with
            start = state.sampling.grammar_start
            g = state.grammar = RequestGrammar(self._compiler().matcher(spec), start)
            for pos in range(start, len(state.token_ids)):
                g.accept(state.token_ids[pos], pos)
        if w.is_decode and w.token != USE_RESIDENT:
            g.accept(w.token, w.start)  # host-logits mode: the id the driver sampled (a no-op if known)
        if g.active and g.next_position != w.sample_position:
            log.warning("grammar matcher at position %d, row samples %d; the request is unconstrained from here",
                        g.next_position, w.sample_position)
            g.active = False
        return g
