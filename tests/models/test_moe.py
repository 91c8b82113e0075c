"""MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers, the grouped expert compute
against a per-token reference, and tensor / expert parallelism over two processes."""

from __future__ import annotations

import socket
import types

import pytest
import torch
import torch.nn.functional as F

from kvserve.distributed.comm import Group
from kvserve.distributed.parallel import Parallel
from kvserve.layers.moe import FusedMoE
from kvserve.models import load_model
from tests.models.conftest import PagedRunner, kernel_type

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5, num_experts_per_tok=2)


def _config(name: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if name == "mixtral":  # every layer sparse, 4 experts
        return MixtralConfig(**SMALL, intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
                             rope_theta=1e6, sliding_window=None)
    if name == "qwen2_moe":  # q/k/v bias, shared expert, layers 0 and 2 dense (decoder_sparse_step 2)
        return Qwen2MoeConfig(**SMALL, intermediate_size=96, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, num_hidden_layers=3, num_experts=8,
                              decoder_sparse_step=2, norm_topk_prob=False, rope_theta=1e6)
    if name == "qwen3_moe":  # q/k norm, renormalised top k, layer 1 dense (mlp_only_layers)
        return Qwen3MoeConfig(**SMALL, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=3, num_experts=8, mlp_only_layers=[1], norm_topk_prob=True,
                              rope_theta=1e6)
    raise ValueError(name)


ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
TOKENS = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 200, 31, 77, 150, 9, 260, 45, 88, 2, 120]
ATOL = 1e-4  # float32 logits of the whole model against transformers


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _run_model(model, config, tp_size: int = 1) -> torch.Tensor:
    """Prefill TOKENS[:13] in two chunks, then decode TOKENS[13:] one by one; logits [20, vocab]."""
    local = types.SimpleNamespace(num_key_value_heads=config.num_key_value_heads // tp_size,
                                  head_dim=getattr(config, "head_dim", None) or config.hidden_size //
                                  config.num_attention_heads, num_hidden_layers=config.num_hidden_layers)
    runner = PagedRunner(model, local, block_size=4)
    out = [runner.step(TOKENS[:6]), runner.step(TOKENS[6:13])]
    out += [runner.step([t], decode=True) for t in TOKENS[13:]]
    return torch.cat(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf(arch, make_hf_checkpoint):
    path, hf = make_hf_checkpoint(_config(arch))
    lm = load_model(str(path), dtype="float32")
    assert type(lm.model).__name__ == hf.config.architectures[0]
    ours = _run_model(lm.model, lm.hf_config)
    ref = _hf_logits(hf, TOKENS)
    assert ref.std() > 0.3
    assert (ours - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_matches_hf(arch, make_hf_checkpoint):
    from kvserve import LLM, SamplingParams
    from tests.conftest import assert_greedy_parity, hf_greedy

    path, hf = make_hf_checkpoint(_config(arch))
    prompts = [TOKENS[:7], TOKENS[3:20], [42]]
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    ours = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True),
                        use_tqdm=False)
    llm.close()
    assert_greedy_parity(ours, hf_greedy(hf, prompts, 8))


def test_int8_quantizes_attention_and_dense_mlp_not_experts(make_hf_checkpoint):
    from kvserve.quant import Int8Linear

    path, hf = make_hf_checkpoint(_config("qwen2_moe"))
    lm = load_model(str(path), dtype="float32", quantization="int8")
    layers = lm.model.model.layers
    assert kernel_type(layers[0].self_attn.qkv_proj) is Int8Linear
    assert kernel_type(layers[0].mlp.gate_up_proj) is Int8Linear  # a dense layer
    assert kernel_type(layers[1].mlp.shared_expert.gate_up_proj) is torch.nn.Linear
    assert layers[1].mlp.experts.w13.dtype == torch.float32
    ours = _run_model(lm.model, lm.hf_config)
    ref = _hf_logits(hf, TOKENS)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.7  # measured 0.85: a routing flip moves a lot
    assert (ours - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_missing_expert_weight_is_named(make_hf_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_hf_checkpoint(_config("mixtral"))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weight tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2"):
        load_model(str(path), dtype="float32")


def _hf_block(arch: str, dtype: torch.dtype):
    """transformers' sparse block (its default experts implementation) and ours with the same weights."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from kvserve.models.moe import MixtralDecoderLayer, QwenMoeDecoderLayer

    hf_cls, layer_cls, layer = {"mixtral": (MixtralSparseMoeBlock, MixtralDecoderLayer, 0),
                                "qwen2_moe": (Qwen2MoeSparseMoeBlock, QwenMoeDecoderLayer, 1),
                                "qwen3_moe": (Qwen3MoeSparseMoeBlock, QwenMoeDecoderLayer, 0)}[arch]
    config = _config(arch)
    config._experts_implementation = "grouped_mm"  # what a whole model picks by default; None means eager
    torch.manual_seed(0)
    hf = hf_cls(config)
    for p in hf.parameters():
        p.data.normal_(0, 0.1)
    sd = hf.state_dict()
    ours = layer_cls.build_mlp(config, Parallel(), layer)
    mine = {"gate.weight": sd["gate.weight"], "experts.w13": sd["experts.gate_up_proj"],
            "experts.w2": sd["experts.down_proj"]}
    if "shared_expert_gate.weight" in sd:
        mine["shared_expert_gate.weight"] = sd["shared_expert_gate.weight"]
        mine["shared_expert.gate_up_proj.weight"] = torch.cat([sd["shared_expert.gate_proj.weight"],
                                                              sd["shared_expert.up_proj.weight"]])
        mine["shared_expert.down_proj.weight"] = sd["shared_expert.down_proj.weight"]
    ours.load_state_dict(mine)
    return hf.to(dtype), ours.to(dtype)


@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_block_matches_hf_block_in_bfloat16(arch):
    """Same routing dtypes, same per-expert matmuls, same sum over the k slots: in bfloat16 our block
    gives transformers' outputs to the last bit (its eager experts loop would differ by one ulp)."""
    hf, ours = _hf_block(arch, torch.bfloat16)
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        ref = hf(x)
        ref = (ref[0] if isinstance(ref, tuple) else ref).reshape(37, 64)
        got = ours(x[0])
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref.float()).abs().max().item() < 1e-6


# ---- the layer: grouped compute, parallel layouts, bad sizes -------------------------------------------

E, H, I, K = 8, 32, 24, 2


def _expert_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (0.2 * torch.randn(E, I, H, generator=g), 0.2 * torch.randn(E, H, I, generator=g),
            0.2 * torch.randn(E, I, H, generator=g))


def _fused(parallel: Parallel | None = None, renormalize: bool = True, weights_fp32: bool = False,
           seed: int = 0) -> FusedMoE:
    moe = FusedMoE(E, K, H, I, parallel, renormalize=renormalize, weights_fp32=weights_fp32)
    w1, w2, w3 = _expert_weights(seed)
    for e in range(E):
        moe.weight_loader(moe.w13, w1[e], (e, "w1"))
        moe.weight_loader(moe.w13, w3[e], (e, "w3"))
        moe.weight_loader(moe.w2, w2[e], (e, "w2"))
    return moe


def _inputs(t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=g), 2 * torch.randn(t, E, generator=g)


def _naive(x: torch.Tensor, logits: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    w1, w2, w3 = (w.double() for w in _expert_weights())
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        top, ids = torch.topk(probs, K)
        if renormalize:
            top = top / top.sum()
        for w, e in zip(top, ids):
            xt = x[t].double()
            out[t] += w * (w2[e] @ (F.silu(w1[e] @ xt) * (w3[e] @ xt)))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("weights_fp32", [True, False])
def test_grouped_experts_match_per_token_reference(renormalize, weights_fp32):
    moe = _fused(renormalize=renormalize, weights_fp32=weights_fp32)
    for t in (1, 5, 64):
        x, logits = _inputs(t, seed=t)
        ours = moe(x, logits)
        assert ours.shape == x.shape and ours.dtype == torch.float32
        assert (ours.double() - _naive(x, logits, renormalize)).abs().max().item() < 1e-5
    assert moe(x[:0], logits[:0]).shape == (0, H)


def test_bfloat16_experts_close_to_reference():
    moe = _fused().to(torch.bfloat16)
    x, logits = _inputs(16)
    ours = moe(x.bfloat16(), logits.bfloat16())
    assert ours.dtype == torch.bfloat16
    ref = _naive(x, logits.bfloat16().float(), True)
    assert (ours.double() - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_bad_parallel_sizes_name_the_flag():
    three = Parallel(tp=Group(list(range(3)), 0))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide moe_intermediate_size \(32\)"):
        FusedMoE(6, 2, H, 32, three)
    FusedMoE(6, 2, H, 32, Parallel(tp=three.tp, enable_expert_parallel=True))  # 2 whole experts per rank
    with pytest.raises(ValueError, match=r"enable_expert_parallel with tensor_parallel_size=3 does not divide "
                                         r"num_experts \(4\)"):
        FusedMoE(4, 2, H, 33, Parallel(tp=three.tp, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide intermediate_size"):
        FusedMoE(4, 2, H, 32, three, intermediate_name="intermediate_size")


def test_weight_loader_rejects_wrong_shapes_and_skips_other_ranks_experts():
    moe = FusedMoE(E, K, H, I)
    with pytest.raises(ValueError, match=r"expert 2 w2: shape \(24, 32\)"):
        moe.weight_loader(moe.w2, torch.zeros(I, H), (2, "w2"))
    with pytest.raises(ValueError, match="unknown expert weight"):
        moe.weight_loader(moe.w13, torch.zeros(I, H), (E, "w1"))
    rank1 = FusedMoE(E, K, H, I, Parallel(tp=Group([0, 1], 1), enable_expert_parallel=True))
    assert rank1.w13.shape == (E // 2, 2 * I, H) and rank1.expert_start == E // 2
    rank1.w13.data.zero_()
    rank1.weight_loader(rank1.w13, torch.ones(I, H), (0, "w1"))  # rank 0's expert: nothing happens
    assert rank1.w13.abs().sum() == 0
    rank1.weight_loader(rank1.w13, torch.ones(I, H), (5, "w3"))
    assert rank1.w13[1, I:].eq(1).all() and rank1.w13[1, :I].eq(0).all()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_worker(rank: int, port: int, models: list[tuple[str, torch.Tensor]]) -> None:
    """One rank of a tp=2 group: the layer and whole models, tensor- then expert-parallel, against
    their one-rank results. Both layouts use the same process group (expert parallel is a flag on it),
    so one pair of processes checks both."""
    import dataclasses

    import torch.distributed as dist

    from kvserve.distributed.parallel import init_distributed

    torch.set_num_threads(1)
    tp_parallel = init_distributed(rank, 2, 1, f"tcp://127.0.0.1:{port}", enable_expert_parallel=False,
                                   timeout_s=30)
    try:
        for ep in (False, True):
            parallel = dataclasses.replace(tp_parallel, enable_expert_parallel=ep)
            single, split = _fused(), _fused(parallel)
            assert split.expert_parallel == ep and split.w13.shape[:2] == ((E // 2, 2 * I) if ep else (E, I))
            for t in (1, 2, 7, 16):  # 1 token: rank 1's slice is empty under expert parallel
                x, logits = _inputs(t, seed=t)
                diff = (split(x, logits) - single(x, logits)).abs().max().item()
                assert diff < 1e-5, f"layer, expert_parallel={ep}, {t} tokens: max diff {diff}"
            for path, ref in models:
                lm = load_model(path, dtype="float32", parallel=parallel)
                diff = (_run_model(lm.model, lm.hf_config, tp_size=2) - ref).abs().max().item()
                assert diff < 1e-4, f"{path}, expert_parallel={ep}: max logit diff {diff}"
    finally:
        dist.destroy_process_group()


def test_two_ranks_tensor_and_expert_parallel_match_one_rank(make_hf_checkpoint):
    import torch.multiprocessing as mp

    models = []
    for arch in ARCHS:
        path, _ = make_hf_checkpoint(_config(arch), name=arch)
        lm = load_model(str(path), dtype="float32")
        models.append((str(path), _run_model(lm.model, lm.hf_config)))
    mp.spawn(_two_rank_worker, args=(_free_port(), models), nprocs=2, join=True)


@pytest.mark.slow
def test_llm_expert_parallel_greedy_matches_hf(make_hf_checkpoint):
    """End to end: two worker processes, attention tensor-parallel, experts expert-parallel."""
    from kvserve import LLM, SamplingParams
    from tests.conftest import assert_greedy_parity, hf_greedy

    path, hf = make_hf_checkpoint(_config("qwen2_moe"))
    prompts = [TOKENS[:7], TOKENS[3:20], [42]]
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
              enable_expert_parallel=True)
    try:
        ours = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.close()
    assert_greedy_parity(ours, hf_greedy(hf, prompts, 8))
