"""Constrained decoding on a real target: constrained plain decoding vs constrained speculation
through the same engine (greedy, token equality checked), and the grammar work's share of a
step. Prints, per drafter: tokens, target forwards, seconds, tokens/s, speed-up over constrained
plain, whether the output equals it, and the mask time (per-node masks, pruning, forced tokens)
per step against the step's time.

    PYTHONPATH=src python scripts/constrained_speed.py [--model qwen2.5-coder-1.5b-instruct]
        [--drafters none,prompt-lookup,suffix,auto] [--threads 2] [-n 256]

``none`` with speculation on drafts only the tokens the grammar forces (jump-forward).
``--llama-server PATH`` adds llama.cpp's server on the same GGUF, threads and prompt tokens with
the same schema (``json_schema``: llama.cpp turns it into a GBNF grammar), greedy; its decode
rate is the server's own ``timings.predicted_per_second``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
import urllib.request

from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.constraints import constraint_for, speculation
from verispec.engine import engine as engine_module
from verispec.system import set_threads
from verispec.types import SamplingParams

SCHEMA = {  # the shape of a GitHub issue as its REST API returns it (a subset of fields)
    "type": "object", "additionalProperties": False,
    "required": ["title", "state", "labels", "assignees", "milestone", "body", "comments"],
    "properties": {
        "title": {"type": "string", "maxLength": 80}, "state": {"enum": ["open", "closed"]},
        "labels": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                              "required": ["name", "color", "description"],
                                              "properties": {"name": {"type": "string"}, "color": {"type": "string"},
                                                             "description": {"type": "string", "maxLength": 60}}}},
        "assignees": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                                 "required": ["login", "id", "site_admin"],
                                                 "properties": {"login": {"type": "string"}, "id": {"type": "integer"},
                                                                "site_admin": {"type": "boolean"}}}},
        "milestone": {"type": "object", "additionalProperties": False, "required": ["title", "number", "state"],
                      "properties": {"title": {"type": "string", "maxLength": 80}, "number": {"type": "integer"},
                                     "state": {"enum": ["open", "closed"]}}},
        "body": {"type": "string", "maxLength": 300}, "comments": {"type": "integer"}}}
PROMPT = ("Write the JSON of a GitHub issue about a crash when parsing empty YAML files in a Python library: "
          "3 labels (bug, parser, good first issue, each with a color and a description), 2 assignees, "
          "milestone v2.1 (number 7, open), a body of two sentences, 4 comments.")


class Timed:
    """Wraps a function of the engine module and sums its time."""

    def __init__(self, name: str):
        self.name, self.fn, self.seconds, self.calls = name, getattr(engine_module, name), 0.0, 0
        setattr(engine_module, name, self)

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def llama_server_rate(binary: str, gguf: str, threads: int, prompt: list[int],
                      max_new_tokens: int) -> tuple[float, int, str]:
    """(decode tokens/s, tokens, text) of llama.cpp's server constrained by ``SCHEMA``, greedy."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([binary, "-m", gguf, "-t", str(threads), "-c", "4096", "--port", str(port), "--no-webui",
                             "--log-disable"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if json.load(urllib.request.urlopen(f"{url}/health", timeout=1)).get("status") == "ok":
                    break
            except OSError:
                time.sleep(0.5)
        body = {"prompt": prompt, "n_predict": max_new_tokens, "temperature": 0, "json_schema": SCHEMA,
                "cache_prompt": False}
        post = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                      {"content-type": "application/json"})
        json.load(urllib.request.urlopen(post, timeout=600))  # warm-up
        out = json.load(urllib.request.urlopen(post, timeout=600))
        return out["timings"]["predicted_per_second"], out["timings"]["predicted_n"], out["content"]
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafters", default="none,prompt-lookup,suffix,auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=384)
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (optional)")
    args = ap.parse_args()
    set_threads(args.threads)
    model = load_model(args.model)
    ids = encode_prompt(model, PROMPT)
    t0 = time.perf_counter()
    constraint = constraint_for(model, "json_schema", SCHEMA)
    print(f"{model.name} on {model.backend.description}; schema compiled in {time.perf_counter() - t0:.2f} s "
          f"(vocabulary included)")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, constraint=constraint)
    timers = [Timed("mask_logits"), Timed("shape_draft")]
    _ = speculation  # the wrapped functions live there
    print("drafter          tokens  forwards  seconds  tok/s  speed-up  equal  mask_ms/step  step_ms  mask_share")
    plain_ids, plain_s = None, None
    for name in ["plain", *args.drafters.split(",")]:
        dec = SpecDecoder(model, "none" if name == "plain" else name, num_draft_tokens=16, prefix_cache_mb=0)
        dec.generate(PROMPT, SamplingParams(max_new_tokens=4, constraint=constraint))  # warm-up
        for t in timers:
            t.seconds = 0.0
        req = dec.engine.add_request(ids, params, draft_limit=0 if name == "plain" else None)
        start = time.perf_counter()
        while not req.finished:
            dec.engine.step(req)
        seconds = time.perf_counter() - start
        out = req.generated
        if plain_ids is None:
            plain_ids, plain_s = out, seconds
            if req.finished == "eos":  # complete: valid JSON (the schema was enforced token by token)
                json.loads(model.tokenizer.decode(out))
        steps = max(req.stats.target_forwards - 1, 1)
        mask = sum(t.seconds for t in timers)
        print(f"{name:15} {len(out):7} {req.stats.target_forwards:9} {seconds:8.2f} {len(out) / seconds:6.1f}"
              f" {plain_s / seconds:8.2f}x  {str(out == plain_ids):5} {mask / steps * 1e3:13.2f}"
              f" {seconds / steps * 1e3:8.1f} {mask / seconds:10.2%}")
    if args.llama_server:
        rate, n, text = llama_server_rate(args.llama_server, str(model.source.path), args.threads, ids,
                                          args.max_new_tokens)
        print(f"llama.cpp server, same schema as a grammar: {n} tokens, {rate:.1f} tok/s decode; "
              f"constrained plain here {len(plain_ids) / plain_s:.1f} tok/s; same text: "
              f"{text == model.tokenizer.decode(plain_ids)}")
    print(model.tokenizer.decode(plain_ids))


if __name__ == "__main__":
    main()
