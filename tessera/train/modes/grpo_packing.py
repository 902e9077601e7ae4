"""How the GRPO step (grpo.py) lays out its rollouts for the policy's forward: one `Chunk` per
micro-batch, the model's input and how its logits map onto the completions' tokens.

    chunks = shared_prefix_chunks(prompts, rollouts, group_size, micro_batch, advantages)   # the default
    chunks = row_chunks(prompts, rollouts, group_size, micro_batch, advantages, multiple)   # the fallback

Per-completion rows (`pack_rollouts`, `row_chunks`): each completion after its prompt, one row each,
so a group's prompt is computed `group_size` times. Shared-prefix rows (`shared_prefix_chunks`, the
default, train.grpo.shared_prefix): a group in one row, "prompt, completion 1[:-1], ..., completion
G[:-1]", each completion attending to the prompt and itself at the positions it has alone
(tessera.models.attention_variants.shared_prefix); its first token is scored from the prompt's last position, each
other from its own previous token. The prompt is computed once and its gradient is the sum over the
group's completions, as the rows give. The step falls back to rows, saying why in its start-up
lines, where the model or the layout cannot serve them (`shared_prefix_refusal`).

Either way a chunk's `targets` are shaped as its logits ([R, K]), and the log-probabilities taken
on them reshape to the completions' [n, T] (`mask`, `engine`, `advantages` per completion), where
the objective is computed the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.models.attention_variants.shared_prefix import PADDING, PREFIX, SharedPrefixMask
from tessera.models.model_input import ModelInput
from tessera.train.objectives.loss import IGNORE_INDEX


@dataclass
class Chunk:
    """One micro-batch's n completions: the model's input rows and their completion targets."""

    tokens: torch.Tensor  # [R, S] the input token ids
    targets: torch.Tensor  # [R, K] the token each logit row scores (IGNORE_INDEX: none)
    mask: torch.Tensor  # [n, T] the completions' tokens (R x K = n x T)
    engine: torch.Tensor  # [n, T] the engine's log-probability of each (fp32)
    advantages: torch.Tensor  # [n]
    logit_positions: torch.Tensor | None = None  # [K] or [R, K]: the positions whose logits are taken
    positions: torch.Tensor | None = None  # [R, S] shared-prefix rows: each token's position
    segments: torch.Tensor | None = None  # [R, S] shared-prefix rows: 0 prompt, j completion j, -1 padding

    def model_input(self, device: torch.device, attention_dtype: torch.dtype | None = None) -> ModelInput:
        """The input of the policy (and of the reference) on `device`; `attention_dtype`: the shared-prefix
        rows' attention computes in it (float64: train.grpo.fp64_attention, the policy's)."""
        def on(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        cache = None
        if self.segments is not None:
            cache = SharedPrefixMask(self.segments.to(device), self.positions.to(device), attention_dtype)
        return ModelInput(tokens=self.tokens.to(device), positions=on(self.positions), cache=cache,
                          logit_positions=on(self.logit_positions))


def pack_rollouts(prompts: list[list[int]], completions: list[list[int]], engine_logps: list[list[float]],
                  group_size: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each completion after its prompt, padded with 0 to the longest: tokens [N, L], the mask of the
    completion's targets [N, L - 1] and the engine's log-probabilities on them [N, L - 1] (fp32).
    L - 1 is rounded up to a multiple of `multiple` (sequence parallelism splits the inputs over tp)."""
    rows = [prompts[i // group_size] + c for i, c in enumerate(completions)]
    length = -(-(max(len(r) for r in rows) - 1) // multiple) * multiple + 1
    seqs = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length - 1, dtype=torch.bool)
    engine = torch.zeros(len(rows), length - 1, dtype=torch.float32)
    for i, (row, completion) in enumerate(zip(rows, completions)):
        start = len(row) - len(completion) - 1  # the target index of the completion's first token
        seqs[i, :len(row)] = torch.tensor(row)
        mask[i, start:len(row) - 1] = True
        engine[i, start:len(row) - 1] = torch.tensor(engine_logps[i], dtype=torch.float32)
    return seqs, mask, engine


def row_tokens(prompts: list[list[int]], completions: list[list[int]], group_size: int, multiple: int = 1) -> int:
    """The tokens of the per-completion rows, N x L as `pack_rollouts` pads them: what a step reports as
    its `tokens` in either layout."""
    longest = max(len(prompts[i // group_size]) + len(c) for i, c in enumerate(completions))
    return len(completions) * (-(-(longest - 1) // multiple) * multiple + 1)


def row_chunks(prompts: list[list[int]], completions: list[list[int]], engine_logps: list[list[float]],
               group_size: int, micro_batch: int, advantages: torch.Tensor, multiple: int = 1) -> list[Chunk]:
    """Per-completion rows, `micro_batch` prompts' completions a chunk. The logits cover the target
    positions from the chunk's earliest completion target on (a sequence-sharded input, `multiple` > 1,
    keeps every position)."""
    seqs, mask, engine = pack_rollouts(prompts, completions, engine_logps, group_size, multiple)
    y = seqs[:, 1:].masked_fill(~mask, IGNORE_INDEX)
    chunks, n = [], micro_batch * group_size
    for i in range(len(prompts) // micro_batch):
        rows = slice(i * n, (i + 1) * n)
        m = mask[rows]
        first = int(m.any(0).nonzero()[0]) if multiple == 1 and bool(m.any()) else 0
        positions = torch.arange(first, m.shape[1]) if first else None
        chunks.append(Chunk(tokens=seqs[rows, :-1], targets=y[rows, first:], mask=m[:, first:],
                            engine=engine[rows, first:], advantages=advantages[rows], logit_positions=positions))
    return chunks


def shared_prefix_chunks(prompts: list[list[int]], completions: list[list[int]], engine_logps: list[list[float]],
                         group_size: int, micro_batch: int, advantages: torch.Tensor) -> list[Chunk]:
    """Shared-prefix rows (module docstring), `micro_batch` groups a chunk, each completion's T tokens
    (T: the step's longest completion) at columns j T .. j T + T - 1 of its group's logit rows."""
    G, T = group_size, max(len(c) for c in completions)
    chunks = []
    for i in range(len(prompts) // micro_batch):
        groups = range(i * micro_batch, (i + 1) * micro_batch)
        rows = [_group_row(prompts[p], completions[p * G:(p + 1) * G], T) for p in groups]
        S = max(len(r[0]) for r in rows)
        tokens = torch.zeros(len(rows), S, dtype=torch.long)
        positions = torch.zeros(len(rows), S, dtype=torch.long)
        segments = torch.full((len(rows), S), PADDING, dtype=torch.long)
        for r, (ids, pos, seg, _, _) in enumerate(rows):
            tokens[r, :len(ids)], positions[r, :len(ids)], segments[r, :len(ids)] = (
                torch.tensor(ids), torch.tensor(pos), torch.tensor(seg))
        index = torch.stack([r[3] for r in rows])
        targets = torch.stack([r[4] for r in rows])
        done = slice(groups[0] * G, (groups[-1] + 1) * G)
        mask, engine = _completion_table(completions[done], engine_logps[done], T)
        chunks.append(Chunk(tokens=tokens, targets=targets, mask=mask, engine=engine, advantages=advantages[done],
                            logit_positions=index, positions=positions, segments=segments))
    return chunks


def _group_row(prompt: list[int], group: list[list[int]], T: int
               ) -> tuple[list[int], list[int], list[int], torch.Tensor, torch.Tensor]:
    """One group's row: its token ids, positions and segments, and per completion token [G x T] the
    row index whose logits score it and the token itself (IGNORE_INDEX past the completion's end)."""
    n = len(prompt)
    ids, pos, seg = list(prompt), list(range(n)), [PREFIX] * n
    index = torch.zeros(len(group) * T, dtype=torch.long)
    targets = torch.full((len(group) * T,), IGNORE_INDEX, dtype=torch.long)
    for j, completion in enumerate(group):
        start, fed = len(ids), len(completion) - 1  # the last token is a target only
        ids += completion[:-1]
        pos += range(n, n + fed)
        seg += [j + 1] * fed
        index[j * T:j * T + len(completion)] = torch.tensor([n - 1] + list(range(start, start + fed)))
        targets[j * T:j * T + len(completion)] = torch.tensor(completion)
    return ids, pos, seg, index, targets


def _completion_table(completions: list[list[int]], engine_logps: list[list[float]], T: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The completions' token mask [n, T] and the engine's log-probabilities [n, T] (fp32), left-aligned."""
    mask = torch.zeros(len(completions), T, dtype=torch.bool)
    engine = torch.zeros(len(completions), T, dtype=torch.float32)
    for k, (completion, logps) in enumerate(zip(completions, engine_logps)):
        mask[k, :len(completion)] = True
        engine[k, :len(completion)] = torch.tensor(logps, dtype=torch.float32)
    return mask, engine
