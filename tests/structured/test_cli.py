"""`kvserve generate --json-schema FILE` and `--regex RE`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve.cli import main
from kvserve.engine_args import EXIT_BAD_INPUT

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "big": {"type": "boolean"}}, "required": ["city", "big"]}


@pytest.mark.slow
def test_generate_with_a_json_schema_and_a_regex(tmp_path, capsys):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    assert main(["generate", "--prompt", "The capital of France as JSON", "--chat", "--json-schema", str(path),
                 "--max-tokens", "40", "--kv-cache-memory", "64MiB", "--dtype", "float32", "--max-num-batched-tokens", "256"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMA)
    assert main(["generate", "--prompt", "Call me at", "--regex", r"\d{3}-\d{4}", "--max-tokens", "20",
                 "--kv-cache-memory", "64MiB", "--dtype", "float32", "--max-num-batched-tokens", "256"]) == 0
    assert re.fullmatch(r"\d{3}-\d{4}", capsys.readouterr().out.strip())


def test_an_invalid_regex_is_refused_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr("kvserve.cli.engine_from_args", lambda args: pytest.fail("the model was loaded"))
    assert main(["generate", "--prompt", "x", "--regex", "a(b"]) == EXIT_BAD_INPUT
    assert "structured_outputs.regex: " in capsys.readouterr().err


def test_a_missing_schema_file_and_both_flags_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--json-schema .*nope.json"):
        main(["generate", "--prompt", "x", "--json-schema", str(tmp_path / "nope.json")])
    with pytest.raises(SystemExit, match="not both"):
        main(["generate", "--prompt", "x", "--json-schema", "f", "--regex", "a"])
