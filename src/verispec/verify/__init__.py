"""Verification: target logits + a draft tree -> accepted tokens (pure functions, no model calls).

Terms follow vLLM: *accepted* draft tokens, then one more token from the target: the
*recovered* token (sampled from the residual after a rejection) or the *bonus* token
(sampled at the end of a fully accepted path)."""

from .acceptance import Acceptance, verify_tree

__all__ = ["Acceptance", "verify_tree"]
