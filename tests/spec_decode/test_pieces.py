"""Speculative decoding's pieces on their own: the n-gram drafter, verification (greedy identity,
and the sampled path's distribution by a chi-squared test with a deliberately half-wrong
drafter, so the rejection path runs), and the adaptive-k rule with injected acceptance rates."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.spec_decode.adaptive import AdaptiveK, best_k, best_k_for, expected_tokens
from kvserve.spec_decode.ngram import propose_ngram
from kvserve.spec_decode.rejection import verify_greedy, verify_sampled


# ---- n-gram lookup --------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_earlier_match():
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(toks, 2, 1, 3) == [7, 8]  # [1 2 3] last seen before 7 8
    assert propose_ngram(toks, 5, 1, 3) == [7, 8, 1, 2, 3]
    assert propose_ngram([5, 6, 7, 8], 3, 1, 3) == []  # nothing recurs
    assert propose_ngram([4, 4], 3, 1, 3) == [4]
    assert propose_ngram([1, 2], 0, 1, 3) == []


def test_ngram_prefers_the_longest_suffix():
    # "2 3" recurs twice: after [9 2 3] -> 5, after [1 2 3] -> 6; the 3-gram [1 2 3] decides.
    toks = [1, 2, 3, 6, 0, 9, 2, 3, 5, 0, 1, 2, 3]
    assert propose_ngram(toks, 1, 1, 3) == [6]
    assert propose_ngram(toks, 1, 1, 2) == [5]  # only up to 2-grams: the latest "2 3"
    assert propose_ngram(toks, 1, 4, 4) == []  # min_n above any match


# ---- verification ---------------------------------------------------------------------------

def test_greedy_keeps_drafts_while_they_equal_the_argmax():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept + bonus
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first mismatch: the target's token
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert verify_greedy([3], []) == [3]


def _chi2_p(observed: list[int], expected: list[float]) -> float:
    """Upper tail of the chi-squared statistic (Wilson-Hilferty normal approximation)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    dof = sum(1 for e in expected if e > 0) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_sampled_tokens_follow_the_target_distribution(with_draft_probs):
    """The first emitted token's histogram over many draws equals p_0, whether the draft is kept
    or rejected; the drafter is right about half the time."""
    torch.manual_seed(0)
    vocab, n = 8, 4000
    p = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
    probs = torch.stack([p, p.flip(0)])  # k = 1: the row after the draft is another distribution
    q = torch.full((vocab,), 0.02)
    q[5] = 1 - 0.02 * (vocab - 1)  # the drafter loves a token the target rarely picks
    gen = torch.Generator().manual_seed(1)
    counts = [0] * vocab
    kept = 0
    for _ in range(n):
        draft = [int(torch.multinomial(q, 1, generator=gen))] if with_draft_probs else \
            [5 if torch.rand(1, generator=gen) < 0.5 else 0]
        out = verify_sampled(probs, draft, q[None] if with_draft_probs else None, gen)
        counts[out[0]] += 1
        kept += len(out) == 2
    assert 0.05 * n < kept < 0.95 * n  # both the accept and the rejection path ran
    assert _chi2_p(counts, [float(x) * n for x in p]) > 0.01


def test_sampled_bonus_token_follows_the_last_row():
    torch.manual_seed(0)
    p0 = torch.tensor([0.0, 1.0, 0.0, 0.0])  # the draft (1) is always kept
    p1 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    gen = torch.Generator().manual_seed(2)
    counts = [0] * 4
    n = 3000
    for _ in range(n):
        out = verify_sampled(torch.stack([p0, p1]), [1], None, gen)
        assert out[0] == 1 and len(out) == 2
        counts[out[1]] += 1
    assert _chi2_p(counts, [float(x) * n for x in p1]) > 0.01


def test_sampled_is_reproducible_with_a_seed():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), dim=-1)
    runs = [verify_sampled(probs, [1, 2, 3], None, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify_sampled(probs, [1, 2], None)


# ---- adaptive k -----------------------------------------------------------------------------

def test_expected_tokens_and_best_k():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert best_k(0.9, 8, 0.05) == 8  # drafts nearly always right, cheap: draft the most
    assert best_k(0.05, 8, 0.1) == 0  # nearly always wrong: a wider step never pays
    assert 0 < best_k(0.6, 8, 0.1) < 8


def test_adaptive_k_shrinks_on_rejections_and_retries_later():
    ak = AdaptiveK(k_max=6, cost_per_token=0.1, prior=0.6, retry_after=4, max_batch=8)
    k0 = ak.num_drafts("r", batch_decodes=1)
    assert k0 > 0
    for _ in range(10):
        ak.observe("r", drafted=4, accepted=0)
    assert ak.rate("r") < 0.1
    ks = [ak.num_drafts("r", 1) for _ in range(4)]
    assert ks[:3] == [0, 0, 0] and ks[3] == k0  # after retry_after idle steps: the prior again
    for _ in range(10):
        ak.observe("s", drafted=4, accepted=4)
    assert ak.num_drafts("s", 1) == 6


def test_bursty_drafts_keep_k_where_independent_drafts_would_shrink_it():
    # n-gram drafts come in runs: half the steps keep all 4, half none. Per position, the first
    # draft is kept half the time and the others always once it was: E(k) = 1 + k / 2, which beats
    # the step's price of 0.47 a token (measured on a compute-bound CPU, BENCHMARKS.md) at every k.
    ak = AdaptiveK(k_max=4, cost_per_token=0.47, smoothing=0.3)
    for i in range(40):
        ak.observe("r", drafted=4, accepted=4 if i % 2 else 0)
    assert 0.3 < ak.rate("r") < 0.7
    assert ak.num_drafts("r", 1) == 4
    # one per-draft rate for the same steps (8 kept of 10 reached: 0.5 per step on average) shrinks k
    assert best_k(0.5, 4, 0.47) <= 1
    assert best_k_for([0.5, 1.0, 1.0, 1.0], 4, 0.47) == 4
    assert best_k_for([0.5, 1.0, 1.0, 1.0], 4, 0.6) == 0  # dearer than what a draft yields: none


def test_adaptive_k_is_off_in_large_batches():
    ak = AdaptiveK(k_max=4, max_batch=8)
    assert ak.num_drafts("r", batch_decodes=7) > 0
    assert ak.num_drafts("r", batch_decodes=8) == 0


def test_price_of_a_query_token_is_a_median_one_slow_step_does_not_set():
    from kvserve.config import SpeculativeConfig
    from kvserve.spec_decode.proposer import PRICE_WINDOW, SpecDecodeProposer

    sp = SpecDecodeProposer(SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 4}), 128)
    for i in range(PRICE_WINDOW):
        sp.observe_step(1, False, 0.010 if i != 3 else 0.050)  # plain steps, one of them slowed down
        sp.observe_step(5, True, 0.018)  # 4 drafts: 0.8 of a step more, 0.2 a token
    assert sp.adaptive.cost_per_token == pytest.approx(0.2)
    sp.observe_step(5, True, 0.100)  # a verify step that lost its core
    assert sp.adaptive.cost_per_token == pytest.approx(0.2)
    assert sp.adaptive.num_drafts("r", 1) == 4
    for _ in range(PRICE_WINDOW // 2 + 1):  # a lasting change moves it
        sp.observe_step(5, True, 0.030)
    assert sp.adaptive.cost_per_token == pytest.approx(0.5)
    sp.observe_step(1, True, 0.001)  # a drafted step of one row (drafts cut to none) is no price
    assert sp.adaptive.cost_per_token == pytest.approx(0.5)
