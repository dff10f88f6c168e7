"""The errors every layer may raise, in a module that imports nothing: sampling and
verification raise ``NonFiniteLogits`` without depending on the model backends."""

from __future__ import annotations


class ModelError(ValueError):
    """A model could not be found or loaded; the message names what was expected."""


class NonFiniteLogits(ModelError):
    """A model computed NaN or +inf logits, or a row of logits with no finite value, where a
    token is chosen: its weights or metadata are corrupt (a Q4_K block with NaN scales, a NaN
    norm weight). Raised instead of sampling from it (a traceback) or taking its argmax (token 0
    forever). The server answers it with a 500: the model, not the request, is at fault."""
