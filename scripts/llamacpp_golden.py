"""Regenerate the llama.cpp golden files for the Qwen2.5-Coder and Gemma 3 270M GGUFs (tests/data/).

    python scripts/llamacpp_golden.py tokenizer   # tests/data/qwen_tokenizer_golden.json
    python scripts/llamacpp_golden.py greedy      # tests/data/qwen_llamacpp_greedy.json
    python scripts/llamacpp_golden.py gemma       # tests/data/gemma_llamacpp_golden.json (llama-server)

Needs a llama.cpp build (``--bin``, default /work/cache/llama.cpp/build/bin) and the GGUF
files (``--model-15b``, ``--model-05b``). Every string goes to the tools as one argv element
(exact bytes: newlines, tabs, trailing spaces), with ``--no-escape`` so llama.cpp does not
turn a literal backslash-n into a newline.

tokenizer: ``llama-tokenize --ids --no-bos --no-escape --log-disable`` on each case, once
with llama.cpp's default special-token parsing (``parse_special=true``: "<|im_end|>" in the
text becomes the control token) and, for the control-looking strings, once more with
``--no-parse-special`` (the text is split as plain text).

greedy: llama-server ``/completion`` on 127.0.0.1 (``-t 2 -tb 2``, one slot), raw prompt (no
chat template), temperature 0 and top_k 1 (argmax), ``return_tokens`` for the sampled ids;
its ``content`` is exactly the continuation. The server tokenizes a string prompt with
add_special = true (BOS only if the GGUF says ``tokenizer.ggml.add_bos_token``; Qwen's says
false) and parse_special = true. Cross-check: llama-simple (``llama_sampler_init_greedy``,
llama.cpp's default thread count, prompt echo removed) must print the same text
(``llama_simple_same_text``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path("/work/cache/llama.cpp/build/bin")
M15 = Path("/tmp/models/qwen1.5b.gguf")
M05 = Path("/tmp/models/qwen0.5b.gguf")

PYTHON_CODE = '''def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b
'''
C_CODE = '#include <stdio.h>\n\nint main(void) {\n\tfor (int i = 0; i < 10; ++i) {\n\t\tprintf("%d\\n", i);\n\t}\n\treturn 0;\n}\n'
JSON_TEXT = '{\n  "name": "verispec",\n  "version": "0.1.0",\n  "tags": ["llm", "spec"],\n  "nested": {"a": [1, 2.5, null, true]}\n}'

CASES = [
    # code
    PYTHON_CODE,
    C_CODE,
    JSON_TEXT,
    "```python\nprint('hi')\n```\n",
    "class Foo:\n    def __init__(self):\n        self.x = {}  # dict\n\n\n    def bar(self): return self.x",
    "fn main() { let v: Vec<u8> = vec![0xFF, 0x1a]; println!(\"{:?}\", v); }",
    # plain text / punctuation
    "Hello, world!",
    "https://example.com/path?q=1&r=2#frag",
    # unicode
    "你好，世界！这是一个测试。",
    "こんにちは世界、カタカナとひらがな",
    "안녕하세요 세계",
    "I ❤️ 🦀 and 🐍! 👨‍👩‍👧‍👦 🇫🇷",
    "Café naïve façade résumé Ångström Zoë",
    "مرحبا بالعالم",
    "# コメント\nx = 'ü'  # 5 µs → ∞",
    # whitespace
    "a  b   c    d     e",
    "        indented by eight",
    "\tx\t\ty\t\t\tz",
    "line1\nline2\n\n\nline3\n",
    "\n\n\n",
    "trailing spaces   ",
    "   leading spaces",
    "windows\r\nline\r\nendings\r\n",
    " \n \t \n  ",
    # digits
    "1234567890",
    "3.14159 2.71828 -0.5e-10",
    "2024-01-15 12:34:56, 15/01/2024",
    "123456789012345678901234567890",
    # contractions
    "don't won't I'm you're it's we'd they've",
    "I'LL DON'T WE'VE SHE'D",
    # control-token-looking text
    "<|im_end|>",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text before <|endoftext|> text after",
    "<|fim_prefix|>def f():\n    <|fim_suffix|>\n<|fim_middle|>",
    "<|not_a_token|> <im_end> <|im_end",
]
CONTROL_CASES = [c for c in CASES if "<|" in c or "<im_" in c]

GREEDY_PROMPTS = ["def fibonacci(n):\n", "The capital of France is", "import numpy as np\n\ndef softmax(x):\n"]

GEMMA = Path.home() / ".cache/verispec/models/gemma-3-270m-q4_k_m.gguf"  # verispec's catalog gemma-3-270m
GEMMA_TEXTS = [
    "Hello world", "The capital of France is Paris.", "  leading spaces and\ttabs\nnewline",
    "Le café est très bon à Montréal.", "Größere Straßenbahnen fahren über die Brücke.",
    "¿Dónde está la biblioteca? ¡Allí!", "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "東京は日本の首都です。", "北京欢迎你，我们一起学习中文。", "서울은 한국의 수도입니다.", "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם", "नमस्ते दुनिया, आप कैसे हैं?", "Γειά σου Κόσμε", "emoji 🤖🚀 and math: ∑ x² ≤ ∞",
    "def f(x):\n    return x**2  # code", "1234567890 3.14159 1,000,000", "Ünïcödé çãsès ñ",
    "<start_of_turn>user\nhi<end_of_turn>\n", "Đây là tiếng Việt có dấu.", "trailing spaces   ", "\n\n\n",
]
GEMMA_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
                 "The three primary colors are", "Water boils at", "La capitale de l'Italie est",
                 "Photosynthesis is the process by which", "1, 2, 3, 4, 5,"]


def dump(obj) -> str:
    """JSON with 1-space indentation, each list of ints on one line."""
    text = json.dumps(obj, ensure_ascii=False, indent=1)
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  text) + "\n"


def llamacpp_version(bin_dir: Path) -> str:
    out = subprocess.run([str(bin_dir / "llama-cli"), "--version"], capture_output=True, text=True)
    m = re.search(r"version: (\S+) \((\w+)\)", out.stdout + out.stderr)
    # built from the llama-cpp-python sdist: no git history, so the build number is meaningless
    return f"commit {m.group(2)} (vendored in llama-cpp-python 0.3.16)" if m else "unknown"


def tokenize(bin_dir: Path, model: Path, text: str, parse_special: bool) -> list[int]:
    cmd = [str(bin_dir / "llama-tokenize"), "-m", str(model), "--ids", "--no-bos", "--no-escape", "--log-disable",
           "-p", text]
    if not parse_special:
        cmd.append("--no-parse-special")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]  # the id list is printed as [a, b, c]
    if len(lines) != 1:
        raise RuntimeError(f"unexpected llama-tokenize output for {text!r}: {out!r}")
    return json.loads(lines[-1])


def gguf_meta(model: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(model)
    keep = {}
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.pre", "general.name"):
        f = r.fields.get(key)
        if f is not None:
            v = f.parts[f.data[0]]
            keep[key] = bytes(v).decode() if f.types and f.types[0].name == "STRING" else v.tolist()[0]
    return keep


def cmd_tokenizer(args) -> None:
    version = llamacpp_version(args.bin)
    meta = gguf_meta(args.model_15b)
    out = {
        "source": f"llama.cpp {version} llama-tokenize on qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "command": "llama-tokenize -m MODEL --ids --no-bos --no-escape --log-disable -p TEXT",
        "parse_special": True,
        "add_bos": False,
        "gguf": meta,
        "note": "cases: llama.cpp's default parsing (parse_special=true: control-token text such as <|im_end|> "
                "becomes the control token id). cases_no_parse_special: the control-looking strings again with "
                "--no-parse-special (parse_special=false: tokenized as plain text). No BOS is added "
                "(--no-bos; Qwen's GGUF has add_bos_token=false anyway). --no-escape: the text is passed verbatim.",
        "cases": [{"text": t, "ids": tokenize(args.bin, args.model_15b, t, True)} for t in CASES],
        "cases_no_parse_special": [{"text": t, "ids": tokenize(args.bin, args.model_15b, t, False)}
                                   for t in CONTROL_CASES],
    }
    # the 0.5B shares the tokenizer: check it tokenizes identically (recorded, not asserted)
    same = all(tokenize(args.bin, args.model_05b, c["text"], True) == c["ids"] for c in out["cases"])
    out["same_ids_on_0.5b_gguf"] = same
    dest = ROOT / "tests/data/qwen_tokenizer_golden.json"
    dest.write_text(dump(out))
    print(f"wrote {dest}: {len(out['cases'])} + {len(out['cases_no_parse_special'])} cases, 0.5B same ids: {same}")


def simple_generate(bin_dir: Path, model: Path, prompt: str, n: int) -> str:
    """llama-simple's continuation: its stdout is the prompt's pieces, then the generated
    pieces, then one newline (greedy sampler, llama.cpp's default thread count)."""
    res = subprocess.run([str(bin_dir / "llama-simple"), "-m", str(model), "-n", str(n), prompt],
                         capture_output=True, check=True)
    full = res.stdout.decode("utf-8")
    if not full.startswith(prompt) or not full.endswith("\n"):
        raise RuntimeError(f"llama-simple output is not prompt + continuation + newline: {full[:200]!r}")
    return full[len(prompt):-1]


class Server:
    """llama-server on 127.0.0.1 (one slot, ``threads`` threads for prompt and generation)."""

    def __init__(self, bin_dir: Path, model: Path, threads: int, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-tb",
                                      str(threads), "-c", "2048", "-np", "1", "--host", "127.0.0.1", "--port",
                                      str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.close()
                raise RuntimeError("llama-server did not come up")
            time.sleep(0.5)

    def complete(self, prompt: str, n: int) -> dict:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "samplers": ["top_k", "temperature"],
                "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True, "seed": 0}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def tokenize(self, text: str) -> list[int]:
        """The server's tokenization of a string prompt: special tokens added and parsed."""
        body = {"content": text, "add_special": True, "parse_special": True}
        req = urllib.request.Request(self.url + "/tokenize", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["tokens"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def cmd_gemma(args) -> None:
    server = Server(args.bin, args.gemma, args.threads, args.port)
    try:
        tokenizer = {t: server.tokenize(t) for t in GEMMA_TEXTS}
        greedy = [(p, server.complete(p, args.n)) for p in GEMMA_PROMPTS]
    finally:
        server.close()
    out = {"source": f"llama.cpp of llama-cpp-python 0.3.16 (scripts/build_llamacpp.sh): llama-server on "
                     f"{args.gemma.name}, {args.threads} threads; /tokenize "
                     "(add_special and parse_special: BOS added, as tokenizer.ggml.add_bos_token asks) and "
                     "/completion, greedy (temperature 0, top_k 1), raw prompts",
           "tokenizer": tokenizer,
           "greedy": [{"prompt": p, "n": args.n, "text": r["content"], "ids": r.get("tokens"),
                       "stop": r.get("stop_type")} for p, r in greedy]}
    dest = ROOT / "tests/data/gemma_llamacpp_golden.json"
    dest.write_text(dump(out))
    print(f"wrote {dest}: {len(tokenizer)} tokenizer cases, {len(greedy)} greedy continuations")


def cmd_greedy(args) -> None:
    version = llamacpp_version(args.bin)
    cases = []
    for label, model in (("qwen2.5-coder-1.5b-instruct", args.model_15b), ("qwen2.5-coder-0.5b-instruct", args.model_05b)):
        meta = gguf_meta(model)
        server = Server(args.bin, model, args.threads, args.port)
        try:
            results = [server.complete(p, args.n) for p in GREEDY_PROMPTS]
        finally:
            server.close()
        for prompt, res in zip(GREEDY_PROMPTS, results):
            text = res["content"]
            simple = simple_generate(args.bin, model, prompt, args.n) if not args.no_simple else None
            cases.append({"model": label, "gguf": model.name, "prompt": prompt, "n": args.n, "text": text,
                          "ids": res.get("tokens"), "n_generated": res.get("tokens_predicted"),
                          "stop": res.get("stop_type"), "prompt_ids": tokenize(args.bin, model, prompt, True),
                          "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                          "llama_simple_same_text": None if simple is None else simple == text})
            print(f"{label} {prompt!r}: {text!r} (llama-simple same: {cases[-1]['llama_simple_same_text']})")
    out = {"source": f"llama.cpp {version}: llama-server /completion, {args.threads} threads, greedy "
                     f"(temperature 0, top_k 1), raw prompts (no chat template); cross-checked with llama-simple "
                     f"(greedy sampler, llama.cpp's default thread count)",
           "note": "text is exactly the continuation (the server's 'content'), ids its sampled token ids "
                   "('tokens', return_tokens=true). No BOS: tokenizer.ggml.add_bos_token is false in both GGUFs "
                   "(the server and llama-simple add BOS only when the vocab asks for it); prompt_ids are the "
                   "prompt's tokens (llama-tokenize, parse_special=true, as the server tokenizes a string prompt). "
                   "stop 'limit' = n tokens generated; 'eos' = stopped at an end-of-generation token (not in ids).",
           "cases": cases}
    dest = ROOT / "tests/data/qwen_llamacpp_greedy.json"
    dest.write_text(dump(out))
    print(f"wrote {dest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("tokenizer", "greedy", "gemma"))
    ap.add_argument("--bin", type=Path, default=BIN)
    ap.add_argument("--model-15b", type=Path, default=M15)
    ap.add_argument("--model-05b", type=Path, default=M05)
    ap.add_argument("--gemma", type=Path, default=GEMMA)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--no-simple", action="store_true", help="skip the llama-simple cross-check")
    args = ap.parse_args()
    {"tokenizer": cmd_tokenizer, "greedy": cmd_greedy, "gemma": cmd_gemma}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
