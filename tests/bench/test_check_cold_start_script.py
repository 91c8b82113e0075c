"""scripts/check_cold_start.py's comparison of two starts' tuning decisions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_cold_start.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_cold_start", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_differences_name_each_decision_that_moved(check):
    quiet = {"dtype": "float32", "activations": "int16", "dense_from": {"2048x2048:4bit": 64, "5632x2048:4bit": None},
             "dense_dtype": {"2048x2048:4bit": "bfloat16", "5632x2048:4bit": None}}
    assert check.differences(quiet, dict(quiet)) == []
    busy = {**quiet, "activations": "float32", "dense_from": {"2048x2048:4bit": 128, "5632x2048:4bit": None}}
    assert check.differences(busy, quiet) == ["activations: float32 vs int16",
                                              "dense_from[2048x2048:4bit]: 128 vs 64"]
    # a start that measured no dtype (a GGUF: float32 without timing) against one that did
    assert check.differences({k: v for k, v in quiet.items() if k != "dtype"}, quiet) == ["dtype: None vs float32"]
