"""Peer baselines: other engines on the same weights, same prompts, same process.

* transformers ``generate`` on the materialized HF directory of the target: plain
  (``hf-generate``), prompt lookup (``hf-pld``: ``prompt_lookup_num_tokens``), assisted
  generation with a draft model (``hf-assisted``: ``assistant_model``).
* llama.cpp through ``llama-cpp-python`` on the model's GGUF (the file our HF directory was
  dequantized from; llama.cpp computes with the quantized blocks): plain (``llamacpp``)
  and prompt lookup (``llamacpp-pld``: ``LlamaPromptLookupDecoding``). Optional extra
  ``[llamacpp]``; :func:`llamacpp_available` says whether it is installed.
* llama.cpp's own ``llama-server`` binary (scripts/build_llamacpp.sh builds it from the same
  vendored llama.cpp): plain (``llamacpp-server``) and speculative with a draft GGUF
  (``llamacpp-server-spec``, its best flags on our sweeps by default). Its vendored
  version (llama.cpp 4227c9be, llama-cpp-python 0.3.16) has no ``--spec-type ngram-*``: its
  n-gram lookup exists only as the one-shot ``llama-lookup`` example, not in the server.

Peers are public APIs used as documented: target forwards are counted with a forward hook
(``register_forward_hook``) that exists only during a ``generate`` call; llama.cpp's KV
cache is reset before every prompt so no prefix is reused between methods or repeats.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import torch

from ..types import SamplingParams
from ..models.base import model_bytes
from .runners import Generation, Runner, sync


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def cut_at_eos(ids: list[int], eos_ids: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], str]:
    """Generated ids up to (excluding) the first EOS, at most ``max_new_tokens``.

    Example: cut_at_eos([5, 6, 2, 0, 0], (2,), 8) -> ([5, 6], "eos");
    cut_at_eos([5, 6, 7], (2,), 2) -> ([5, 6], "length").
    """
    for i, t in enumerate(ids[:max_new_tokens]):
        if t in eos_ids:
            return ids[:i], "eos"
    return ids[:max_new_tokens], "length"


class _ForwardCounter:
    """Counts a module's forward calls and when the first one returned, via a forward
    hook registered on entry and removed on exit (``with _ForwardCounter(model) as c``)."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.count, self.first_end = module, 0, None

    def _hook(self, module, args, output) -> None:
        self.count += 1
        if self.first_end is None:
            self.first_end = time.perf_counter()

    def __enter__(self) -> "_ForwardCounter":
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


class HFGenerateRunner(Runner):
    """transformers ``generate``: ``mode`` is "plain", "pld" or "assisted"."""

    def __init__(self, label: str, model: torch.nn.Module, mode: str, num_draft_tokens: int,
                 eos_ids: tuple[int, ...], max_ngram: int = 2, assistant: torch.nn.Module | None = None):
        if mode not in ("plain", "pld", "assisted"):
            raise ValueError(f"unknown transformers mode {mode!r}")
        if (mode == "assisted") != (assistant is not None):
            raise ValueError("an assistant model is needed exactly for assisted generation")
        self.label, self.model, self.mode, self.assistant = label, model.eval(), mode, assistant
        self.k, self.eos_ids, self.max_ngram = num_draft_tokens, eos_ids, max_ngram

    def _config(self, params: SamplingParams):
        from transformers import GenerationConfig

        # ignore_eos: an empty (not None: None is filled in from the model's config) EOS list
        # never stops, and EOS stays a normal token, as in our engine (min_new_tokens would
        # instead mask EOS and change the output).
        kw: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "pad_token_id": self.eos_ids[0] if self.eos_ids else 0,
                              "eos_token_id": [] if params.ignore_eos else list(self.eos_ids)}
        if params.greedy:
            kw |= {"do_sample": False}
        else:
            kw |= {"do_sample": True, "temperature": params.temperature,
                   "top_k": params.top_k or None, "top_p": params.top_p}
        if self.mode == "pld":
            kw |= {"prompt_lookup_num_tokens": self.k, "max_matching_ngram_size": self.max_ngram}
        return GenerationConfig(**kw)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt_ids], device=device)  # [1, T]
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        if not params.greedy:
            torch.manual_seed(params.seed)  # transformers samples from the global generator
        sync(device)
        with _ForwardCounter(self.model) as counter, torch.inference_mode():
            t0, c0 = time.perf_counter(), time.process_time()
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      generation_config=self._config(params), **extra)
            sync(device)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        eos = () if params.ignore_eos else self.eos_ids
        gen, reason = cut_at_eos(out[0, len(prompt_ids):].tolist(), eos, params.max_new_tokens)
        prefill = counter.first_end - t0 if counter.first_end else None
        return Generation(tuple(gen), reason, wall, prefill, counter.count, max(counter.count - 1, 0),
                          None, None, None, None, cpu)

    def memory_bytes(self) -> int:
        """The peer's own copy of the target weights (+ the assistant's)."""
        return model_bytes(self.model) + (model_bytes(self.assistant) if self.assistant is not None else 0)


def load_hf_model(hf_dir: Path, dtype: torch.dtype, num_layers: int | None = None) -> torch.nn.Module:
    """The target (or its first ``num_layers`` layers, an untrained layer-skip draft) as a
    plain transformers model from the same materialized directory our backends load."""
    from transformers import AutoModelForCausalLM

    kw = {"num_hidden_layers": num_layers} if num_layers else {}
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, attn_implementation="sdpa", **kw).eval()


def configure_assistant(assistant: torch.nn.Module, num_draft_tokens: int, confidence: float) -> None:
    """Assisted generation reads its draft length from the assistant's generation config
    (transformers' documented knob): a constant ``num_draft_tokens``, and the dynamic
    confidence cut-off (transformers' default 0.4; 0 disables it)."""
    from transformers import GenerationConfig

    assistant.generation_config = GenerationConfig(
        num_assistant_tokens=num_draft_tokens, num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=confidence)


class LlamaCppRunner(Runner):
    """llama-cpp-python on a GGUF, plain or with its prompt-lookup draft model."""

    def __init__(self, label: str, gguf: Path, eos_ids: tuple[int, ...], threads: int,
                 n_ctx: int, num_draft_tokens: int | None = None, max_ngram: int = 2):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        pld = num_draft_tokens is not None
        draft = LlamaPromptLookupDecoding(max_ngram_size=max_ngram, num_pred_tokens=num_draft_tokens) if pld else None
        # logits_all=True with a draft model: 0.3.36 crashes past 512 tokens otherwise.
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         logits_all=pld, draft_model=draft, verbose=False)
        self.label, self.eos_ids, self.gguf = label, eos_ids, gguf

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if len(prompt_ids) + params.max_new_tokens + 16 > self.llm.n_ctx():
            raise ValueError(f"{self.label}: prompt of {len(prompt_ids)} tokens does not fit n_ctx {self.llm.n_ctx()}")
        sampling = ({"temp": 0.0} if params.greedy else
                    {"temp": params.temperature, "top_k": params.top_k, "top_p": params.top_p})
        self.llm.set_seed(params.seed)
        self.llm.reset()  # no KV prefix reuse across prompts, methods or repeats
        eos = () if params.ignore_eos else self.eos_ids
        out, reason, first = [], "length", None
        t0, c0 = time.perf_counter(), time.process_time()
        for tok in self.llm.generate(prompt_ids, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, **sampling):
            first = first or time.perf_counter()
            if tok in eos:
                reason = "eos"
                break
            out.append(int(tok))
            if len(out) >= params.max_new_tokens:
                break
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return Generation(tuple(out), reason, wall, (first - t0) if first else None,
                          None, None, None, None, None, None, cpu)

    def memory_bytes(self) -> int:
        return self.gguf.stat().st_size  # weights are mmapped from the file


def llama_server_bin() -> Path | None:
    """llama.cpp's ``llama-server``: ``$LLAMACPP_BIN/llama-server``, else the build of
    scripts/build_llamacpp.sh in the model cache (``<cache>/llama.cpp/build/bin``); None if neither."""
    import os

    from ..models.model_cache import default_cache_dir

    for d in filter(None, (os.environ.get("LLAMACPP_BIN"), default_cache_dir() / "llama.cpp" / "build" / "bin")):
        exe = Path(d) / "llama-server"
        if exe.is_file() and os.access(exe, os.X_OK):
            return exe
    return None


def _stop(proc) -> None:
    """Kill a server process and reap it."""
    proc.kill()
    proc.wait()


class LlamaServerRunner(Runner):
    """llama.cpp's ``llama-server`` on a GGUF, plain or speculative with a draft GGUF (``draft``:
    ``--draft-max``, ``--draft-p-min``, ``-td`` from ``spec``), one server process per method,
    greedy, prompts sent as token ids. Its slot keeps the previous prompt's K/V and reuses the
    common prefix (``cache_prompt``, as our prefix cache: an agent's next turn prefills only what is
    new); the speculative server speculates only with it on. Times are the server's own
    (``prompt_ms``, ``predicted_ms``); tau from ``draft_n_accepted``. ``spec["poll"]``: llama.cpp's
    ``--poll`` (50, its default: threads spin while they wait; 0 sleeps: on a machine shared with
    other jobs spinning threads collapse, 10x and worse at load 10 on 2 cores); ``spec["fa"]``: its
    ``--flash-attn`` (off by default in this version; on a quiet AVX-512 Zen 5 with 2 threads,
    ``llama-bench`` gave it no gain: 36.9 vs 36.1 tok/s decoding at depth 0, 28.4 vs 30.7 at depth
    2048, prefill 126 vs 132 tok/s, so off is its best there). After the warm-up
    its slot is erased (``reset_learned``, as our methods clear their prefix caches): the warm-up runs
    the first measured prompt, whose prefill would otherwise be free."""

    def __init__(self, label: str, exe: Path, gguf: Path, eos_ids: tuple[int, ...], threads: int, n_ctx: int,
                 draft: Path | None = None, spec: dict[str, float] | None = None, start_timeout_s: float = 600):
        import socket
        import subprocess
        import tempfile
        import weakref

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        spec = spec or {}
        self._slots = tempfile.TemporaryDirectory()  # llama-server answers slot actions (erase) only with one
        weakref.finalize(self, self._slots.cleanup)
        cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1",
               "--port", str(self.port), "--host", "127.0.0.1", "--no-webui", "--poll", str(int(spec.get("poll", 50))),
               "--slot-save-path", self._slots.name] + (["--flash-attn"] if spec.get("fa") else [])
        if draft is not None:
            td = str(int(spec.get("td", threads)))
            cmd += ["-md", str(draft), "-cd", str(n_ctx), "--draft-max", str(int(spec.get("draft_max", 4))),
                    "--draft-min", "0", "--draft-p-min", str(spec.get("p_min", 0.75)), "-td", td, "-tbd", td]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        weakref.finalize(self, _stop, self.proc)  # never outlives the bench
        self.label, self.gguf, self.draft, self.eos_ids = label, gguf, draft, eos_ids
        deadline = time.time() + start_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.time() > deadline:
                _stop(self.proc)
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise ValueError(f"{label}: llama-server did not start ({tail[0][:200]})")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:  # refused while starting, 503 while loading
            return False

    def reset_learned(self) -> None:
        """Erase the slot's K/V: the next prompt is prefilled whole (``POST /slots/0?action=erase``)."""
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/slots/0?action=erase", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        import json
        import urllib.request

        if not params.greedy:
            raise ValueError(f"{self.label}: llama-server peers run greedy only")
        body = {"prompt": prompt_ids, "n_predict": params.max_new_tokens, "temperature": 0.0, "top_k": 1,
                "samplers": ["top_k"], "cache_prompt": True, "return_tokens": True, "ignore_eos": params.ignore_eos,
                "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
        t = out["timings"]
        ids, reason = cut_at_eos([int(x) for x in out.get("tokens", [])],
                                 () if params.ignore_eos else self.eos_ids, params.max_new_tokens)
        decoded = max(int(t["predicted_n"]) - 1, 0)
        accepted = int(t.get("draft_n_accepted", 0))
        prefill, decode = t["prompt_ms"] / 1e3, t["predicted_ms"] / 1e3
        return Generation(tuple(ids), reason, prefill + decode, prefill, None, max(decoded - accepted, 0),
                          int(t.get("draft_n", 0)), accepted, None, None, None,
                          max(len(prompt_ids) - int(t.get("prompt_n", len(prompt_ids))), 0))

    def memory_bytes(self) -> int:
        return self.gguf.stat().st_size + (self.draft.stat().st_size if self.draft else 0)  # mmapped
