"""Responses kept server-side for ``previous_response_id`` and GET / DELETE /v1/responses/{id}.

Rules: a stored response belongs to the API key that made it (the bearer token a request
presents, kept only as its SHA-256; no token is one more owner), and another key's lookup finds
nothing, as an unknown id does, so a key cannot even learn that an id exists. Each entry holds
the response and its whole conversation (the earlier turns' items, this input, this output), so a
chain does not depend on its earlier entries staying stored. The store is bounded in entries and
in bytes (the JSON size of what an entry holds); past either bound the least recently used
entries are dropped, and an entry larger than the byte bound alone is not kept. In memory only:
a restart forgets every response. The store is used on the event loop only (no locking).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def owner_of(authorization: str | None) -> str:
    """The owner a request's ``Authorization`` header names: the SHA-256 of its bearer token
    ("" without one)."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    response: dict[str, Any]  # as GET returns it
    conversation: list[dict[str, Any]]  # input items then output items, every turn of the chain
    nbytes: int


class ResponseStore:
    """An LRU map ``id -> StoredResponse`` of at most ``max_responses`` entries and ``max_bytes``."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self.nbytes = 0  # the entries' sizes summed; <= max_bytes, and len(self) <= max_responses

    def check_integrity(self) -> None:
        """Assert the invariants: the byte count is the entries' sum, both bounds hold, keys are ids."""
        assert self.nbytes == sum(e.nbytes for e in self._entries.values())
        assert self.nbytes <= self.max_bytes and len(self._entries) <= self.max_responses
        assert all(rid == e.response["id"] for rid, e in self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (by its id) for ``owner``; False when it alone exceeds the byte bound."""
        nbytes = len(json.dumps([response, conversation], separators=(",", ":")).encode())
        if nbytes > self.max_bytes:
            return False
        self._drop(response["id"])
        self._entries[response["id"]] = StoredResponse(owner, response, conversation, nbytes)
        self.nbytes += nbytes
        while len(self._entries) > self.max_responses or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The entry ``owner`` stored as ``response_id`` (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        """Forget ``owner``'s ``response_id``; False when ``owner`` has no such response."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
