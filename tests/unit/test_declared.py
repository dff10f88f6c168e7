"""Declared capabilities (issue 24): backends declare ``BackendCaps``, drafters declare the
``Features`` they read, and the engine reads those declarations instead of probing."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import verispec
from verispec.drafters.base import LAST_HIDDEN, NO_FEATURES, DeclaresFeatures, Features, features_of, hidden_request
from verispec.models.base import NOT_CLAIMED, BackendCaps, caps_of


def test_the_engine_probes_nothing():
    engine = Path(verispec.__file__).parent / "engine"
    probes = [f"{p.name}:{i}" for p in sorted(engine.glob("*.py"))
              for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bgetattr\(", line)]
    assert probes == []


def test_caps_of_a_backend_declaring_none_is_the_conservative_default():
    assert caps_of(object()) == BackendCaps() == BackendCaps(
        batched=False, prefix_reuse_exact=False, exactness=NOT_CLAIMED, host_threads=None, min_verify_rows=1,
        copy_prefix=False)
    declared = BackendCaps(batched=True, min_verify_rows=12)
    assert caps_of(SimpleNamespace(caps=declared)) is declared


def test_features_say_what_the_forward_returns():
    out = SimpleNamespace(hidden="last", layers="layers")
    assert not NO_FEATURES.wanted and NO_FEATURES.tag is None
    assert NO_FEATURES.forward_kwargs() == {"want_hidden": False}
    assert LAST_HIDDEN.wanted and LAST_HIDDEN.forward_kwargs() == {"want_hidden": True}
    assert LAST_HIDDEN.select(out) == "last" and LAST_HIDDEN.tag == (("want_hidden", True),)
    eagle3 = Features(layers=(2, 15, 29))
    assert eagle3.wanted and eagle3.forward_kwargs() == {"want_hidden": False, "hidden_layers": (2, 15, 29)}
    assert eagle3.select(out) == "layers" and eagle3.tag != LAST_HIDDEN.tag


def test_features_of_a_drafter_written_before_features():
    """Its ``needs_hidden_states`` / ``hidden_layers`` flags still ask for the same forwards."""
    assert features_of(SimpleNamespace()) == NO_FEATURES
    assert features_of(SimpleNamespace(needs_hidden_states=True)) == LAST_HIDDEN
    old_eagle3 = SimpleNamespace(needs_hidden_states=True, hidden_layers=[0, 2])
    assert features_of(old_eagle3) == Features(layers=(0, 2))
    assert hidden_request(old_eagle3) == {"want_hidden": False, "hidden_layers": (0, 2)}


def test_declared_features_still_answer_the_old_flags():
    class Reader(DeclaresFeatures):
        features = Features(layers=(1,))

    assert Reader().needs_hidden_states and Reader().hidden_layers == (1,)
    assert not DeclaresFeatures().needs_hidden_states and DeclaresFeatures().hidden_layers == ()
