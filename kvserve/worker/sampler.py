"""Vectorized sampling: penalties, temperature, top-k / top-p / min-p, logprobs.

Every step works on the whole [B, V] logits tensor at once; the only Python loop
is over seeded rows, each drawing its noise from its own generator so that a
seeded request gives the same tokens whatever else shares its batch. Semantics
follow vLLM v1 (logprobs are of the raw model distribution; with a grammar, of the distribution
its token bitmask leaves, as vLLM applies the bitmask to the logits before sampling).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from kvserve.sampling_params import SamplingParams

# Temperatures below this are greedy (same cut-off as SamplingParams.greedy).
_GREEDY_EPS = 1e-5
# Slack when deciding whether a cumulative probability "reaches" top_p, so that
# float32 rounding (0.5 + 0.3 -> 0.79999995) does not add an extra token.
_TOP_P_EPS = 1e-6
# Tokens ranked for top-p, in stages: the rows whose nucleus the first stage does not hold are
# ranked again over the next, and the whole vocabulary is sorted only for rows past the last. A
# chat model's nucleus mostly fits in 64 tokens, and torch.topk of 64 costs a fifth of 1024's
# (32 rows x 49,152: 1.3 ms against 6.9 on 2 Zen 4 cores; a full sort 55 ms).
_TOP_P_CANDIDATES = (64, 1024)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]
    generators: dict[int, torch.Generator]
    banned_token_ids: list[list[int]]
    max_num_logprobs: int | None
    all_greedy: bool
    all_random: bool
    # Structured outputs: [B, ceil(V / 32)] int32, bit t % 32 of word t // 32 set = token t allowed
    # (rows of unconstrained requests all ones). None: no row is constrained.
    token_bitmask: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        banned_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        token_bitmask: torch.Tensor | None = None,
    ) -> "SamplingMetadata":
        greedy = [p.greedy for p in params]
        # Greedy rows get neutral filter values: filters only matter when sampling.
        temps = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_ks = [vocab_size if g or p.top_k == -1 else min(p.top_k, vocab_size)
                  for p, g in zip(params, greedy)]
        top_ps = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        min_ps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]

        def f32(values: list[float], neutral: float) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=(None if all(k >= vocab_size for k in top_ks)
                   else torch.tensor(top_ks, dtype=torch.int64, device=device)),
            top_p=f32(top_ps, 1.0),
            min_p=f32(min_ps, 0.0),
            presence_penalty=f32([float(p.presence_penalty) for p in params], 0.0),
            frequency_penalty=f32([float(p.frequency_penalty) for p in params], 0.0),
            repetition_penalty=f32([float(p.repetition_penalty) for p in params], 1.0),
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
            generators=generators,
            banned_token_ids=banned_token_ids,
            max_num_logprobs=max(wanted) if wanted else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            token_bitmask=None if token_bitmask is None else token_bitmask.to(device),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B, K+1] float32; column 0 = sampled token
    logprob_token_ids: torch.Tensor | None  # [B, K+1] int64; column 0 = sampled id
    sampled_ranks: torch.Tensor | None  # [B] int64; 1 = most likely


# ---------------------------------------------------------------------------
# Building blocks (public so tests can check each one on hand-made inputs)
# ---------------------------------------------------------------------------

def _row_token_index(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into (row, token) index tensors for scatter."""
    rows = list(chain.from_iterable([i] * len(toks) for i, toks in enumerate(token_lists)))
    toks = list(chain.from_iterable(token_lists))
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(toks, dtype=torch.int64, device=device))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Tokens a grammar does not allow next -> -inf (a new tensor). A row that allows nothing is
    left as it is: its sampled token is then rejected by the matcher, which ends that request."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(bitmask.size(0), -1)[:, :logits.size(1)]
    allowed |= ~allowed.any(dim=1, keepdim=True)
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def apply_banned(logits: torch.Tensor, banned_token_ids: list[list[int]]) -> torch.Tensor:
    """Set banned tokens to -inf, in place."""
    rows, toks = _row_token_index(banned_token_ids, logits.device)
    if toks.numel():
        logits[rows, toks] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only), in place.

    Works on the (row, token) pairs that occur rather than dense [B, V] masks:
    gathers and scatters into the logits cost O(tokens seen), not O(B * V).
    Repetition and presence gather the old values and write them back without
    accumulating, so a pair listed several times is still penalised once.
    """
    if not _penalised(meta):
        return logits
    device = logits.device
    out_rows, out_toks = _row_token_index(meta.output_token_ids, device)
    if meta.repetition_penalty is not None:
        p_rows, p_toks = _row_token_index(meta.prompt_token_ids, device)
        rows, toks = torch.cat([p_rows, out_rows]), torch.cat([p_toks, out_toks])
        vals = logits[rows, toks]
        rp = meta.repetition_penalty.to(device=device, dtype=logits.dtype)[rows]
        logits[rows, toks] = torch.where(vals > 0, vals / rp, vals * rp)
    if meta.frequency_penalty is not None and out_toks.numel():
        fp = meta.frequency_penalty.to(device=device, dtype=logits.dtype)
        logits.index_put_((out_rows, out_toks), -fp[out_rows], accumulate=True)  # once per occurrence
    if meta.presence_penalty is not None and out_toks.numel():
        pp = meta.presence_penalty.to(device=device, dtype=logits.dtype)
        logits[out_rows, out_toks] = logits[out_rows, out_toks] - pp[out_rows]
    return logits


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value [B] int64 (the first one on ties; NaN counts as the
    largest, as in torch). On the CPU numpy's vectorized argmax: torch's took ~29 us for one row of
    32,000 floats, numpy's 3, and every sampled token pays it."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return x.argmax(dim=-1)
    return torch.from_numpy(x.detach().numpy().argmax(-1).astype("int64", copy=False))


def _penalised(meta: SamplingMetadata) -> bool:
    return not (meta.repetition_penalty is None and meta.frequency_penalty is None and meta.presence_penalty is None)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and the top-p nucleus.

    Both filters become a per-row logit threshold, so tokens tied with the last
    kept token are kept too rather than dropped by an arbitrary sort order.
    Top-p only ranks a candidate set (the top-k, or the best tokens of each
    _TOP_P_CANDIDATES stage in turn, for the rows the stage before did not
    settle); a full-vocabulary sort, which costs far more on CPU, happens only
    for rows whose nucleus reaches past the last stage.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.size(1)
    max_k = 0
    if top_k is not None:
        enabled = top_k < vocab
        max_k = int(top_k[enabled].max()) if bool(enabled.any()) else 0
    stages = [max_k]
    if top_p is not None:
        p_only = top_p < 1.0
        if top_k is not None:
            p_only &= top_k >= vocab
        if bool(p_only.any()):  # a nucleus not bounded by top-k may need many tokens
            stages = sorted({min(vocab, max(max_k, n)) for n in _TOP_P_CANDIDATES} | {vocab})
    if stages[0] == 0:
        return logits
    threshold, overflow = _filter_threshold(logits, top_k, top_p, stages[0])
    rows = overflow.nonzero().squeeze(1) if overflow is not None and bool(overflow.any()) else None
    for n in stages[1:]:  # the rows the smaller candidate set did not settle
        if rows is None:
            break
        threshold[rows], overflow = _filter_threshold(logits[rows], None if top_k is None else top_k[rows],
                                                      top_p[rows], n)
        rows = rows[overflow] if overflow is not None and bool(overflow.any()) else None
    return logits.masked_fill(logits < threshold, float("-inf"))


def _filter_threshold(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, 1] lowest logit kept by top-k / top-p, ranking only the n best tokens.

    Also returns the [B] mask of top-p rows whose nucleus does not fit in those
    n tokens (their threshold is then meaningless), or None when n covers all.
    """
    batch, vocab = logits.shape
    if n < vocab:
        vals, idx = torch.topk(logits, n, dim=-1)  # sorted descending
    else:
        vals, idx = torch.sort(logits, dim=-1, descending=True)  # faster than a full topk
    neg_inf = torch.full((batch, 1), float("-inf"), dtype=logits.dtype, device=logits.device)
    threshold = neg_inf
    k_on = None
    if top_k is not None:
        k_on = (top_k < vocab).unsqueeze(1)
        kth = vals.gather(1, (top_k - 1).clamp(min=0, max=n - 1).unsqueeze(1))
        threshold = torch.where(k_on, kth, neg_inf)
    if top_p is None:
        return threshold, None
    # Probabilities over the whole vocabulary, so rows without top-k need no full sort.
    probs = logits.softmax(dim=-1).gather(1, idx).masked_fill(vals < threshold, 0.0)
    if k_on is not None:
        # A top-k row renormalises over its kept set, which lies inside the candidates.
        probs = probs / torch.where(k_on, probs.sum(dim=-1, keepdim=True), torch.ones_like(threshold))
    cum = probs.cumsum(dim=-1)
    target = (top_p.to(probs.dtype) - _TOP_P_EPS).unsqueeze(1)
    p_on = (top_p < 1.0).unsqueeze(1)
    overflow = (p_on & (cum[:, -1:] < target)).squeeze(1) if n < vocab else None
    # Keep a token while the mass of strictly better tokens has not reached top_p.
    num_keep = ((cum - probs) < target).sum(dim=-1, keepdim=True).clamp(min=1)
    pth = vals.gather(1, num_keep - 1)
    return torch.maximum(threshold, torch.where(p_on, pth, neg_inf)), overflow


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    cutoff = min_p.to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < cutoff, float("-inf"))


def exponential_noise(like: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """q ~ Exp(1) of shape [B, V]: one batched draw for unseeded rows, one per seeded row.

    A seeded row consumes exactly V uniforms of its generator per step, so its
    draws do not depend on the batch it sits in. q = -log(U) with U in [0, 1)
    is never 0 (which would make p / q NaN for masked tokens) and draws much
    faster than exponential_() on CPU.
    """
    q = torch.empty_like(like, dtype=torch.float32)
    if not generators:
        q.uniform_()
    elif len(generators) < q.size(0):
        unseeded = torch.ones(q.size(0), dtype=torch.bool)
        unseeded[list(generators)] = False
        rows = unseeded.nonzero().squeeze(1).to(q.device)
        q[rows] = torch.rand(rows.numel(), q.size(1), device=q.device)
    for row, gen in generators.items():
        torch.rand(q.size(1), generator=gen, device=q.device, out=q[row])
    return q.log_().neg_()


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: argmax(p / q) with q ~ Exp(1) samples from p exactly."""
    q = exponential_noise(probs, generators)
    return row_argmax(probs / q)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Column 0 = logprob of token_ids, then the top-k; plus the rank of token_ids.

    Rank counts strictly better tokens, so ties share the better rank.
    """
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k > 0:
        top_vals, top_ids = torch.topk(logprobs, k, dim=-1)
        values = torch.cat([chosen, top_vals], dim=1)
        ids = torch.cat([token_ids, top_ids], dim=1)
    else:
        values, ids = chosen, token_ids
    return values.float(), ids, ranks.to(torch.int64)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the next prompt tokens: ([N, k+1] values, [N, k+1] ids, [N] ranks)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, target_ids.to(logits.device), k)


# ---------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------

class Sampler:
    """logits [B, V] + SamplingMetadata -> sampled ids (+ raw logprobs when asked)."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw_logprobs, work = self._prepare(logits, meta)
        if meta.all_greedy:
            sampled = row_argmax(work)
        elif meta.all_random:
            sampled = random_sample(self._probs(work, meta), meta.generators)
        else:
            is_greedy = meta.temperature.to(work.device) < _GREEDY_EPS
            sampled = torch.where(is_greedy, row_argmax(work), random_sample(self._probs(work, meta), meta.generators))

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        values, ids, ranks = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, values, ids, ranks)

    def distributions(self, logits: torch.Tensor, meta: SamplingMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What verifying drafted tokens needs of each row (kvserve/spec_decode/rejection.py): its
        greedy pick (argmax after banned tokens and penalties) [B], the distribution a sampling row
        draws from (after temperature, top-k, top-p, min-p) [B, V] (None when every row is greedy),
        and the raw logprobs [B, V] when logprobs are asked."""
        raw_logprobs, work = self._prepare(logits, meta)
        return row_argmax(work), None if meta.all_greedy else self._probs(work, meta), raw_logprobs

    @staticmethod
    def _prepare(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(raw logprobs or None, the logits after banned tokens and penalties)."""
        logits = logits.float()
        if meta.token_bitmask is not None:  # before everything, logprobs included
            logits = apply_token_bitmask(logits, meta.token_bitmask)
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if not any(meta.banned_token_ids) and not _penalised(meta):  # nothing written: no copy
            return raw_logprobs, logits
        work = apply_banned(logits.clone(), meta.banned_token_ids)
        return raw_logprobs, apply_penalties(work, meta)

    @staticmethod
    def _probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temp = meta.temperature.to(device=logits.device, dtype=logits.dtype)
        # Greedy rows are overwritten later; divide them by 1 instead of 0.
        temp = torch.where(temp < _GREEDY_EPS, torch.ones_like(temp), temp)
        logits = logits / temp.unsqueeze(1)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        logits = apply_min_p(logits, meta.min_p)
        return logits.softmax(dim=-1)
