"""Verification of drafted tokens: which of them the target model accepts, and the token after.

The target's forward scores the k drafted tokens of a request as k + 1 query positions: row i is
the target's distribution for the token after draft[:i], with every sampling transform applied
(penalties over the history including draft[:i], temperature, top-k, top-p, min-p, a grammar's
mask). Given those rows:

- greedy: the drafts are kept while each equals its row's argmax; then that row's argmax is
  emitted. The tokens are exactly those of decoding without drafts.
- sampling (Leviathan et al. 2023, Chen et al. 2023): draft x_i, drafted with probability q_i(x_i),
  is kept with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is drawn
  from the residual max(0, p_i - q_i), renormalised; when every draft is kept a bonus token is
  drawn from p_k. Each emitted token is then distributed exactly as p (the target's). A drafter
  that proposes a fixed token (n-gram lookup) has q_i = the point mass at x_i.

The uniforms come from the request's generator (seeded requests repeat), one per draft, then
the draw of the last token.
"""

from __future__ import annotations

import torch


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """target_argmax: the k + 1 rows' argmax. The emitted tokens (1 to k + 1)."""
    out = []
    for i, x in enumerate(draft):
        if target_argmax[i] != x:
            break
        out.append(x)
    out.append(target_argmax[len(out)])
    return out


def verify_sampled(probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None = None) -> list[int]:
    """probs [k + 1, V]: the target's distributions; draft_probs [k, V] the drafter's (None: each
    draft was a fixed proposal, a point mass). The emitted tokens (1 to k + 1)."""
    k = len(draft)
    if probs.shape[0] != k + 1:
        raise ValueError(f"verify_sampled: {probs.shape[0]} target rows for {k} drafts (need k + 1)")
    uniforms = torch.rand(k, generator=generator, device=probs.device) if k else None
    out: list[int] = []
    for i, x in enumerate(draft):
        p = float(probs[i, x])
        q = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if q > 0 and float(uniforms[i]) * q <= p and p > 0:
            out.append(x)
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[x] = 0.0
        else:
            residual = (probs[i] - draft_probs[i]).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: a rejection has probability 0; draw from p
            residual = probs[i]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return out
