"""Draft-model proposals, the proposer of `speculative_method=draft`.

A smaller checkpoint with the target's vocabulary (`speculative_model`) runs greedily a few
tokens ahead of each decoding sequence. It has its own model runner and paged KV cache; each
sequence has a shadow there (its own block table and computed count). Before proposing, a
shadow drops the KV of tokens the target rejected and catches up on the tokens the target
accepted or sampled since (a new sequence: its whole prompt, in passes of at most
`token_budget` tokens); then each pass proposes one more token for every sequence still asking.
"""

from __future__ import annotations

import dataclasses
import logging

from splitfuse.engine.block_manager import BlockManager
from splitfuse.config import EngineConfig
from splitfuse.engine.model_runner import ModelRunner, threads_per_rank
from splitfuse.engine.batch import RaggedBatch
from splitfuse.engine.scheduler import ScheduledChunk
from splitfuse.engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target_vocab_size: int) -> None:
        # Small: it runs whole beside rank 0's shard or pipeline stage, in no rank group, on rank
        # 0's share of the threads (its runner sets the engine thread's count).
        draft_config = dataclasses.replace(
            config, model=config.speculative_model, tokenizer=config.speculative_model,
            speculative_method="none", speculative_model=None, num_kv_blocks=None,
            tensor_parallel_size=1, pipeline_parallel_size=1, num_threads=threads_per_rank(config))
        self.runner = ModelRunner(draft_config)
        if self.runner.args.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_model's vocabulary ({self.runner.args.vocab_size} tokens) differs from "
                             f"the model's ({target_vocab_size}); a draft model must share the tokenizer")
        self.block_size = config.block_size
        self.token_budget = config.token_budget
        # No watermark: a shadow that finds no room simply proposes nothing.
        self.blocks = BlockManager(self.runner.num_kv_blocks, config.block_size, watermark=0.0,
                                   enable_prefix_caching=False)
        self._shadows: dict[Sequence, Sequence] = {}
        self._synced: dict[Sequence, int] = {}  # target tokens seen at each shadow's last sync
        log.info("splitfuse: draft model %s, %d KV blocks", config.speculative_model, self.runner.num_kv_blocks)

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        proposals: dict[Sequence, list[int]] = {}
        limits: dict[Sequence, int] = {}
        for seq, limit in zip(seqs, max_tokens):
            if limit <= 0 or seq.num_tokens + limit > self.runner.max_model_len:
                continue
            shadow = self._sync(seq)
            proposals[shadow], limits[shadow] = [], limit
        asking = list(proposals)
        while asking:
            chunks = self._schedule(asking)
            if not chunks:
                break
            batch = RaggedBatch.build(chunks, self.block_size, self.runner.device)
            tokens = self.runner.execute(batch).argmax(dim=-1).tolist()
            sampling = [c.seq for c in chunks if c.samples]
            for c in chunks:
                c.seq.num_computed_tokens += c.num_tokens
            for shadow, token in zip(sampling, tokens):
                proposals[shadow].append(token)
                shadow.token_ids.append(token)
            live = set(self._shadows.values())
            asking = [s for s in asking if len(proposals[s]) < limits[s] and s in live]
        return [proposals.get(self._shadows.get(seq), []) for seq in seqs]

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq, None)
        self._synced.pop(seq, None)
        if shadow is not None:
            self.blocks.free(shadow)

    def _sync(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow, its tokens now the target's and its KV kept only where they agree."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.prompt_token_ids, _GREEDY, arrival=0)
            self._shadows[seq] = shadow
            self._synced[seq] = 0
        theirs, ours = seq.token_ids, shadow.token_ids
        # The target's tokens only grow: those seen at the last sync still agree; only the
        # shadow's own proposals after them can differ.
        limit = min(shadow.num_computed_tokens, seq.num_tokens)
        agree = min(self._synced[seq], limit)
        while agree < limit and theirs[agree] == ours[agree]:
            agree += 1
        del ours[agree:]
        ours.extend(theirs[agree:])
        self._synced[seq] = len(theirs)
        # At least the last token runs again: the next token comes from its hidden state, which
        # no earlier pass kept (a chunk of no tokens has no row to sample from).
        shadow.num_computed_tokens = min(agree, len(theirs) - 1)
        self.blocks.trim(shadow, shadow.num_tokens)
        return shadow

    def _schedule(self, asking: list[Sequence]) -> list[ScheduledChunk]:
        """One draft pass: every asking shadow's uncomputed tokens up to the token budget; a
        shadow that cannot get KV blocks stops proposing (its KV is dropped)."""
        chunks, budget = [], self.token_budget
        for shadow in asking:
            if budget == 0:
                break
            n = min(shadow.num_uncomputed_tokens, budget)
            end = shadow.num_computed_tokens + n
            if not self.blocks.can_grow(shadow, end):
                self._drop(shadow)
                continue
            self.blocks.grow(shadow, end)
            chunks.append(ScheduledChunk(shadow, n))
            budget -= n
        return chunks

    def _drop(self, shadow: Sequence) -> None:
        for seq, s in list(self._shadows.items()):
            if s is shadow:
                self.release(seq)

    def check_invariants(self) -> None:
        """The draft pool's invariants over the live shadows (for tests)."""
        self.blocks.check_invariants(list(self._shadows.values()))


_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)

