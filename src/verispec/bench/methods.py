"""Method specs on the command line: ``name[:key=value[,key=value...]]``.

A method is either a registered drafter run through our engine (``none``, ``prompt-lookup``,
``draft``, ...) or a *peer*: another engine's implementation on the same weights, run in the
same process on the same prompts (transformers ``generate`` and llama.cpp).

    parse_method("draft:model=truncated:6")
      -> MethodSpec(name="draft", options=(("model", "truncated:6"),))
    parse_method("prompt-lookup:num_candidates=3,max_ngram=4").label
      -> "prompt-lookup:num_candidates=3,max_ngram=4"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BASELINE = "none"  # plain decoding through our engine: the reference for speed and exactness

PEERS: dict[str, str] = {
    "hf-generate": "transformers generate(), plain greedy/sampling (no speculation)",
    "hf-pld": "transformers prompt lookup (prompt_lookup_num_tokens = k; option max_ngram)",
    "hf-assisted": "transformers assisted generation (options: model=<shipped|truncated:N|draft weights dir|name|path>, confidence; default: the shipped distilled draft)",
    "llamacpp": "llama-cpp-python on the model's GGUF, plain decoding (extra [llamacpp])",
    "llamacpp-pld": "llama-cpp-python with LlamaPromptLookupDecoding (option max_ngram; extra [llamacpp])",
    "llamacpp-server": "llama.cpp's llama-server binary (scripts/build_llamacpp.sh or $LLAMACPP_BIN), plain, greedy "
                       "(options poll: its --poll, 50; 0 on a busy machine; fa=1: its --flash-attn)",
    "llamacpp-server-spec": "llama-server with a draft GGUF (options model=<the target's catalog draft|name|path>, "
                            "draft_max=4, p_min=0.75, td=threads: its best configuration on our sweeps; poll, fa), greedy",
}


@dataclass(frozen=True)
class MethodSpec:
    name: str  # a drafter name or a PEERS key
    options: tuple[tuple[str, str], ...] = ()  # in the order given

    @property
    def label(self) -> str:
        """The spec as written (canonical form): the key in records and tables."""
        if not self.options:
            return self.name
        return f"{self.name}:" + ",".join(f"{k}={v}" for k, v in self.options)

    @property
    def kind(self) -> Literal["engine", "hf", "llamacpp"]:
        if self.name.startswith("hf-"):
            return "hf"
        if self.name.startswith("llamacpp"):
            return "llamacpp"
        return "engine"

    @property
    def is_peer(self) -> bool:
        return self.kind != "engine"

    def option_dict(self) -> dict[str, str]:
        return dict(self.options)


def parse_method(text: str, drafters: tuple[str, ...]) -> MethodSpec:
    """Parse ``name[:k=v,...]``; the name must be one of ``drafters`` or a peer.

    Example: parse_method("draft:model=truncated:6", ("none", "draft")) ->
    MethodSpec("draft", (("model", "truncated:6"),)). Raises ValueError naming the problem.
    """
    name, _, rest = text.strip().partition(":")
    if name not in drafters and name not in PEERS:
        raise ValueError(f"unknown method {name!r}; choose a drafter ({', '.join(drafters)}) "
                         f"or a peer ({', '.join(PEERS)})")
    options = []
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"method {text!r}: option {pair!r} must look like key=value")
        options.append((key.strip().replace("-", "_"), value.strip()))
    return MethodSpec(name, tuple(options))


def with_baseline(specs: list[MethodSpec]) -> list[MethodSpec]:
    """The baseline first, then the other methods in the order given, duplicates removed."""
    out = [MethodSpec(BASELINE)]
    for spec in specs:
        if spec.label not in {s.label for s in out}:
            out.append(spec)
    return out
