"""Prefix-aware routing, without Ray: which replica's prefix cache most likely holds a request's prompt.

A request's *routing text* is its prompt as the client sent it (a completions prompt, or a
chat's messages joined role by role), so a conversation's next turn extends the text of its
previous turn. The text is cut into ``BLOCK_CHARS``-character blocks; block i's key hashes
block i with the key of block i - 1 (a chained hash, as the engine's prefix cache keys its
16-token blocks), so a key names a whole prefix. ``PrefixTable`` remembers, for each key, the
replica that last served a request with that prefix (LRU, bounded) and the tails of prompts
that ended just after it; the deepest key of a new request found in the table names the
replica whose cache holds the longest shared prefix, and the tails say whether the request
continues a whole earlier prompt.

    >>> t = PrefixTable(capacity=100)
    >>> a = "x" * 64 + "end"                        # two whole blocks and a tail
    >>> t.insert(prefix_keys(a), a, "r1")
    >>> b = a + " and more"                          # extends it: a continuation
    >>> t.match(prefix_keys(b), b, {"r1", "r2"})
    ('r1', 2, True)
    >>> c = "x" * 64 + "other"                       # shares the two blocks, not the tail
    >>> t.match(prefix_keys(c), c, {"r1", "r2"})
    ('r1', 2, False)
    >>> t.match(prefix_keys("z" * 64), "z" * 64, {"r1", "r2"})
    (None, 0, False)

The Ray Serve request router (``ray_serve.PrefixAwareRouter``) is a thin wrapper over this.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

BLOCK_CHARS = 32  # characters per key: shorter prompts are routed by load alone
MAX_BLOCKS = 1024  # keys per request (32K characters): a longer prompt is placed by its first 32K


def routing_text(path: str, body: bytes) -> str:
    """The text a request's prefix key is made of ("" when the body names no prompt).

    ``routing_text("/v1/completions", b'{"prompt": "Hi"}') == "Hi"``; token-id prompts become
    ``"1,2,3,"`` (a prefix of ids stays a prefix of text); a chat's messages become
    ``"user\\x1fHi\\x1e..."`` (role, unit separator, content, record separator), and so does a
    Responses request's input (``_responses_text``). Malformed
    bodies give "": the replica answers them with its own 400.
    """
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(req, dict):
        return ""
    if path.endswith("/responses"):
        return _responses_text(req)
    if path.endswith("/chat/completions"):
        messages = req.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(f"{m.get('role', '')}\x1f{_content(m.get('content'))}\x1e"
                       for m in messages if isinstance(m, dict))
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        prompt = prompt[0]  # a batch of prompts: placed by the first
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "".join(f"{t}," for t in prompt)
    return ""


def _responses_text(req: dict[str, Any]) -> str:
    """A Responses request's routing text, in the chat's form: its instructions (a system
    message), then its input's messages and tool outputs, so a conversation sent again with its
    next turn (as the OpenAI Agents SDK does) extends its earlier text; a request chained by
    ``previous_response_id`` is placed by its new input alone.

    >>> _responses_text({"instructions": "Be brief.", "input": "Hi"})
    'system\\x1fBe brief.\\x1euser\\x1fHi\\x1e'
    """
    items = req.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return ""
    instructions = req.get("instructions")
    out = [f"system\x1f{instructions}\x1e"] if isinstance(instructions, str) and instructions else []
    for item in items:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append(f"{item.get('role', '')}\x1f{_content(item.get('content'))}\x1e")
        elif kind == "function_call_output":
            out.append(f"tool\x1f{_content(item.get('output'))}\x1e")
    return "".join(out)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prefix_keys(text: str, block: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """Chained 64-bit keys of the text's whole ``block``-character blocks (at most ``max_blocks``):
    key i depends on every character of blocks 0..i, so equal keys mean equal prefixes."""
    keys, prev = [], b""
    for i in range(min(len(text) // block, max_blocks)):
        prev = hashlib.blake2b(prev + text[i * block:(i + 1) * block].encode("utf-8", "surrogatepass"),
                               digest_size=8).digest()
        keys.append(int.from_bytes(prev, "little"))
    return tuple(keys)


class PrefixTable:
    """key -> (the replica that last served that prefix, the tails of the prompts that ended
    in the block after it), least recently used first.

    A request *continues* an earlier prompt when that whole prompt, tail included, is a
    prefix of it (the next turn of a conversation, or the same prompt again): the owner's
    cache holds that prompt and its answer. A request that only *shares* a prefix (a common
    system prompt, the same first words) gains less, and other replicas soon hold it too.

    Invariants: ``len(self) <= capacity``; at most ``MAX_TAILS`` tails per key (the most
    recent); a replica dropped with ``drop`` owns no key."""

    MAX_TAILS = 4

    def __init__(self, capacity: int = 200_000, block: int = BLOCK_CHARS):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.block = capacity, block
        self._owner: OrderedDict[int, tuple[str, tuple[str, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, keys: Sequence[int], text: str, alive: Collection[str]) -> tuple[str | None, int, bool]:
        """(replica, blocks, continuation) of the longest prefix of ``keys`` (the keys of
        ``text``) owned by a replica in ``alive``; (None, 0, False) when none is."""
        for depth in range(len(keys), 0, -1):
            owner, tails = self._owner.get(keys[depth - 1], (None, ()))
            if owner is not None and owner in alive:
                rest = text[depth * self.block:]
                return owner, depth, any(rest.startswith(t) for t in tails)
        return None, 0, False

    def insert(self, keys: Sequence[int], text: str, replica: str) -> None:
        """``replica`` now holds every prefix in ``keys`` and the whole ``text`` (its cache saw
        the prompt); ``text``'s tail (what follows its last whole block) is remembered."""
        for i, k in enumerate(keys):
            old_owner, old_tails = self._owner.get(k, (None, ()))
            tails = old_tails if old_owner == replica else ()
            if i == len(keys) - 1:
                tail = text[len(keys) * self.block:][:self.block]
                tails = ((*[t for t in tails if t != tail], tail))[-self.MAX_TAILS:]
            self._owner[k] = (replica, tails)
            self._owner.move_to_end(k)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def drop(self, replica: str) -> None:
        """Forget a replica (it died: its cache is gone)."""
        for k in [k for k, (r, _) in self._owner.items() if r == replica]:
            del self._owner[k]
