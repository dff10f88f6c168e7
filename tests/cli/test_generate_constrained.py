"""`verispec generate --json-schema FILE` / `--grammar FILE`: the answer follows the file (valid
JSON for the schema, through a speculative drafter), and a bad schema is one line, exit 2."""

from __future__ import annotations

import json

import jsonschema
from serving import one_line_exit_2, runner

from verispec.cli import app as cli_app

SCHEMA = {"type": "object", "required": ["hero", "pets"], "additionalProperties": False,
          "properties": {"hero": {"type": "string", "maxLength": 12},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}}}


def test_generate_follows_a_json_schema(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    r = runner.invoke(cli_app, ["generate", "--model", "stories260k", "--drafter", "prompt-lookup", "-n", "60",
                                "--json-schema", str(path), "--json", "Once upon a time"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["finish_reason"] == "eos"


def test_generate_follows_a_grammar(tmp_path):
    path = tmp_path / "g.gbnf"
    path.write_text('root ::= ("yes" | "no") "!"')
    r = runner.invoke(cli_app, ["generate", "--model", "stories260k", "-n", "10", "--grammar", str(path), "--json",
                                "Once upon a time"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["text"] in ("yes!", "no!")


def test_a_bad_schema_is_one_line(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text('{"type": "strin"}')
    one_line_exit_2("generate", "--model", "stories260k", "--json-schema", str(path), "hi", needle="strin")
