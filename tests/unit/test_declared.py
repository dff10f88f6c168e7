"""Declared capabilities (issue 24): backends declare ``BackendCaps`` and what the loader and
the statistics read, drafters declare the ``Features`` they read, runners and EAGLE head
runners declare what they hold, and the code reads those declarations instead of probing."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import verispec
import verispec.drafters
from verispec.bench.peers import HFGenerateRunner, LlamaCppRunner
from verispec.bench.runners import EngineRunner, Runner
from verispec.drafters.base import LAST_HIDDEN, NO_FEATURES, DeclaresFeatures, Drafter, Features, features_of
from verispec.drafters.eagle_runner import CompiledHeadRunner, TorchHeadRunner
from verispec.models import cpu_abi
from verispec.models.base import NOT_CLAIMED, BackendCaps, CausalLM
from verispec.models.cpu import CpuLlama
from verispec.models.formats import WeightFormat
from verispec.models.hf import HFCausalLM
from verispec.models.native import NativeLlama, NativeOptions

from tiny_models import tiny_llama

SRC = Path(verispec.__file__).parent
# what is declared now: a getattr on one of these names is a probe standing in for the declaration
DECLARED = ("caps", "exactness", "features", "needs_hidden_states", "hidden_layers", "description", "quant",
            "formats", "isa", "threads", "set_threads", "forward_batch", "gguf_path", "resident_bytes",
            "weight_bytes", "reset", "reset_learned", "max_draft", "cost_signature", "head", "runner", "model")


def _getattr_probes(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(file relative to the package, attribute) of every ``getattr(x, "attribute"...)`` or
    ``hasattr(x, "attribute")`` of ``names``."""
    return [(p.relative_to(SRC).as_posix(), m.group(1)) for p in sorted(SRC.rglob("*.py"))
            for m in re.finditer(r"\b(?:get|has)attr\([^,]+,\s*[\"'](\w+)[\"']", p.read_text())
            if m.group(1) in names]


def test_the_engine_probes_nothing():
    engine = SRC / "engine"
    probes = [f"{p.name}:{i}" for p in sorted(engine.glob("*.py"))
              for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bgetattr\(", line)]
    assert probes == []


def test_nothing_probes_for_what_is_declared():
    assert _getattr_probes(DECLARED) == []


def test_a_backend_declaring_nothing_gets_the_conservative_caps():
    assert CausalLM.caps == BackendCaps() == BackendCaps(
        batched=False, prefix_reuse_exact=False, exactness=NOT_CLAIMED, host_threads=None, min_verify_rows=1,
        copy_prefix=False)
    assert CausalLM.gguf_path is None


def _backends() -> dict[str, CausalLM]:
    """One tiny model on every runtime (the compiled one where it is built)."""
    model = tiny_llama(0)
    cfg, state = model.config.to_dict(), model.state_dict()
    out = {"hf": HFCausalLM(model, "tiny"),
           "native": NativeLlama.from_state_dict(cfg, dict(state), NativeOptions(dtype=torch.float32,
                                                                                batch_invariant=False))}
    if cpu_abi.available():
        out["cpu"] = CpuLlama.from_state_dict(cfg, dict(state), 64, quant="q8_0")
    return out


def test_every_backend_declares_what_is_read_of_it():
    backends = _backends()
    classes = {cls for mod in ("cpu", "native", "hf", "cache_pool")
               for _, cls in inspect.getmembers(importlib.import_module(f"verispec.models.{mod}"), inspect.isclass)
               if cls.__module__.startswith("verispec.models") and hasattr(cls, "forward") and cls is not CausalLM}
    assert classes == {CpuLlama, NativeLlama, HFCausalLM, verispec.models.cache_pool.PooledLM}
    assert all(CausalLM in cls.__mro__ for cls in classes)  # subclassing the protocol: its defaults apply
    for name, m in backends.items():
        assert isinstance(m.caps, BackendCaps) and isinstance(m.caps.exactness.bit_exact, bool), name
        assert isinstance(m.description, str) and m.description, name
        assert m.quant in ("none", "q8_0"), name
        assert m.formats in ((WeightFormat.NONE,), (WeightFormat.Q8_0,)), name
        assert all(isinstance(f, WeightFormat) for f in m.formats), name
        assert isinstance(m.threads, int) and m.threads >= 1 and isinstance(m.isa, str), name
        assert m.gguf_path is None and m.resident_bytes > 0, name
    assert (backends["hf"].description, backends["native"].description) == ("hf", "native")
    assert backends["hf"].isa == backends["native"].isa == ""  # torch's kernels
    if "cpu" in backends:
        assert backends["cpu"].isa == cpu_abi.isa_name() and backends["cpu"].threads == torch.get_num_threads()


def test_a_probe_for_a_declared_name_is_found():
    """The scan above finds what it looks for (it would pass vacuously on a broken pattern)."""
    assert _getattr_probes(DECLARED) == []
    found = [m.group(1) for m in re.finditer(r"\b(?:get|has)attr\([^,]+,\s*[\"'](\w+)[\"']",
                                              'getattr(b, "threads", None) and hasattr(backend, "forward_batch")')]
    assert found == ["threads", "forward_batch"]


def test_every_drafter_declares_its_features_and_reset():
    drafters = {cls for info in pkgutil.iter_modules(verispec.drafters.__path__)
                for _, cls in inspect.getmembers(importlib.import_module(f"verispec.drafters.{info.name}"),
                                                 inspect.isclass)
                if cls.__module__.startswith("verispec.drafters") and hasattr(cls, "propose") and cls is not Drafter}
    assert len(drafters) >= 10
    for cls in drafters:
        assert issubclass(cls, DeclaresFeatures), f"{cls.__name__} does not declare features and reset"
        assert isinstance(cls.features, Features) and callable(cls.reset) and callable(cls.cost_signature)
    assert not hasattr(DeclaresFeatures, "needs_hidden_states") and not hasattr(DeclaresFeatures, "hidden_layers")


def test_runners_declare_reset_and_head_runners_their_room():
    assert all(Runner in cls.__mro__ for cls in (EngineRunner, HFGenerateRunner, LlamaCppRunner))
    assert Runner.reset_learned(SimpleNamespace()) is None  # the default: nothing learned
    assert TorchHeadRunner.max_draft is None
    assert "max_draft" in inspect.signature(CompiledHeadRunner).parameters


def test_features_say_what_the_forward_returns():
    out = SimpleNamespace(hidden="last", layers="layers")
    assert not NO_FEATURES.wanted and NO_FEATURES.tag is None
    assert NO_FEATURES.forward_kwargs() == {"want_hidden": False}
    assert LAST_HIDDEN.wanted and LAST_HIDDEN.forward_kwargs() == {"want_hidden": True}
    assert LAST_HIDDEN.select(out) == "last" and LAST_HIDDEN.tag == (("want_hidden", True),)
    eagle3 = Features(layers=(2, 15, 29))
    assert eagle3.wanted and eagle3.forward_kwargs() == {"want_hidden": False, "hidden_layers": (2, 15, 29)}
    assert eagle3.select(out) == "layers" and eagle3.tag != LAST_HIDDEN.tag


def test_features_of_reads_the_declaration_and_names_a_wrong_one():
    class Reader(DeclaresFeatures):
        features = Features(layers=(1,))

    assert features_of(DeclaresFeatures()) == NO_FEATURES and features_of(Reader()) == Features(layers=(1,))
    assert features_of(Reader()).forward_kwargs() == {"want_hidden": False, "hidden_layers": (1,)}

    class Old(DeclaresFeatures):
        features = True  # not a declaration of what is read

    with pytest.raises(TypeError, match="Old.features must be a Features"):
        features_of(Old())


def _private_imports(source: str) -> list[str]:
    """Names with a leading underscore that ``source`` imports from verispec (``from verispec.x
    import _name``); dunders such as ``__version__`` are public."""
    import ast

    return [alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == "verispec" for alias in node.names
            if alias.name.startswith("_") and not alias.name.startswith("__")]


def test_no_test_imports_a_private_name():
    """Tests exercise the public surface: a private name may change without notice (issue 37)."""
    tests = Path(__file__).resolve().parents[1]
    found = [(p.relative_to(tests).as_posix(), name) for p in sorted(tests.rglob("*.py"))
             for name in _private_imports(p.read_text(encoding="utf-8"))]
    assert found == []
    assert _private_imports("from verispec.api import _Detokenizer, SpecDecoder\nfrom verispec import __version__\n"
                            "def f():\n    from verispec.models.cpu import _LIB\n") == ["_Detokenizer", "_LIB"]


def test_readers_do_not_branch_on_architecture_names() -> None:
    """What an architecture decides is a field of its row (``Architecture``): no module of
    ``models/`` but ``architectures.py`` compares a value with an architecture's name or
    model_type (``arch == "qwen2"``, ``cfg["model_type"] == "llama"``, ``in ("gemma3", ...)``)."""
    import ast
    from pathlib import Path

    from verispec.models import architectures

    names = {a.name for a in architectures.ARCHITECTURES.values()} | \
        {a.model_type for a in architectures.ARCHITECTURES.values()}
    found = []
    for path in sorted(Path(architectures.__file__).parent.rglob("*.py")):
        if path.name == "architectures.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                for c in ast.walk(node):
                    if isinstance(c, ast.Constant) and c.value in names:
                        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "architecture names branched on outside architectures.py:\n" + "\n".join(found)


def _concrete_drafters() -> set[str]:
    """The names of the drafter classes of ``verispec.drafters`` (what implements ``Drafter``,
    not the declared protocols and bases)."""
    from verispec.drafters import base

    names = set()
    for info in pkgutil.iter_modules(verispec.drafters.__path__):
        module = importlib.import_module(f"verispec.drafters.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and issubclass(cls, base.DeclaresFeatures) \
                    and cls not in (base.DeclaresFeatures, base.WrappingDrafter, base.StatelessDrafter):
                names.add(name)
    return names


def _capability_violations() -> list[str]:
    """``isinstance`` against a concrete drafter class outside the registry, and ``getattr`` /
    ``hasattr`` on a drafter or runner (a name mentioning one) anywhere in the package."""
    import ast

    concrete, found = _concrete_drafters(), []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
                continue
            if node.func.id == "isinstance" and rel != "registry.py":
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if any(ast.unparse(c).split(".")[-1] in concrete for c in classes):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif node.func.id in ("getattr", "hasattr") and re.search(
                    r"drafter|runner|inner|learned|retrieval", ast.unparse(node.args[0]), re.I):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_capabilities_are_declared_not_probed():
    """Issue 48: code asks a drafter what it can do through declared protocols (``Speculates``,
    ``CountsPrefill``, ``Features``) and declarations (``Runner.predicts``), never by its class
    (outside the registry, which builds them) or by probing attributes."""
    assert {"DraftModelDrafter", "SuffixDecodingDrafter", "PredictionDrafter", "HybridDrafter"} <= _concrete_drafters()
    assert _capability_violations() == []


def test_the_target_cost_has_one_owner():
    """No drafter declares the target's cost (``verify_cost`` is gone from the protocol and every
    drafter): the registry builds the cost model once and hands it to drafters and engines."""
    import ast

    found = [f"{p.relative_to(SRC).as_posix()}:{n.lineno}" for p in sorted(SRC.rglob("*.py"))
             for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
             if isinstance(n, (ast.Attribute, ast.Name)) and (getattr(n, "attr", None) or getattr(n, "id", None))
             == "verify_cost"]
    assert found == []
    assert "verify_cost" not in Drafter.__annotations__
