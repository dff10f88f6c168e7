"""Every declared architecture (``verispec.models.architectures``) on the compiled runtime, from a
tiny random GGUF (``arch_fixtures``): logits agree with transformers' own implementation of that
architecture over 300 positions (F32 and Q8_0 weights), and stay bit-exact by construction (a
chain, a tree and a batch row give bitwise the logits of one token at a time; every ISA gives the
scalar reference's bits). A file asking for what we do not implement is refused, naming the key.

Tolerances. F32: the runtime computes in fp32 with an fp32 K/V cache, as transformers does,
but in another order (and exp from a polynomial): 1e-5 of the logits' scale (measured: 3e-7 to
1.6e-6). Q8_0: the
reference holds the same Q8_0 weight values, but the runtime quantizes activations to int8 per
32 values (llama.cpp's Q8_1) and keeps K/V in fp16: 5e-2 of the logits' scale (measured: 0.008
to 0.01; Gemma's 6 layers under a softcap of 3: 0.042), and the same greedy token at 95% of the
positions at least.
"""

from __future__ import annotations

import pytest
import torch

from arch_fixtures import CASES, write_arch_gguf
from gguf_fixtures import byte_level_vocab
from tiny_models import (
    assert_batch_bitwise,
    assert_chain_bitwise,
    assert_same_bits,
    assert_tree_bitwise,
    available_isas,
    scenario,
)
from verispec.models import cpu_abi
from verispec.models.base import ModelError

if not cpu_abi.available():
    pytest.skip("the compiled runtime verispec._vscpu is not built", allow_module_level=True)

POSITIONS = 300  # past a sliding window of 8 and several 64-slot K tiles
VOCAB = len(byte_level_vocab()[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(GGUF path, transformers reference) of every case and format, written once."""
    root = tmp_path_factory.mktemp("arch")
    return {(kind, fmt): (root / f"{kind}-{fmt}.gguf", write_arch_gguf(root / f"{kind}-{fmt}.gguf", case, fmt))
            for kind, case in CASES.items() for fmt in ("f32", "q8_0")}


def load(path, isa: str | None = None, threads: int = 2):
    from verispec.models.cpu import CpuLlama
    from verispec.models.cpu_weights import gguf_weights
    from verispec.models.gguf_config import open_gguf

    info, cfg = open_gguf(path)
    return CpuLlama.from_weights(cfg, gguf_weights(info, cfg), None, name=path.name, isa=isa, threads=threads)


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
@pytest.mark.parametrize("kind", list(CASES))
def test_logits_agree_with_transformers(files, kind, fmt):
    path, reference = files[kind, fmt]
    model = load(path)
    ids = torch.randint(0, VOCAB, (1, POSITIONS), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(ids).logits[0]
    got = model.forward(ids, torch.arange(POSITIONS)[None], model.new_cache()).logits[0]
    scale = float(want.abs().max())
    err = float((got - want).abs().max()) / scale
    assert err < (1e-5 if fmt == "f32" else 5e-2), f"{kind} {fmt}: max error {err:.2g} of the logits' scale"
    same = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert same >= (1.0 if fmt == "f32" else 0.95), f"{kind} {fmt}: greedy token agrees at {same:.0%} of positions"


@pytest.mark.parametrize("kind", list(CASES))
def test_chain_tree_batch_bitwise(files, kind):
    """Alone == chain == tree node == batch row, bitwise, with 1 and 2 threads (a window of 8
    cuts the keys of every prefix here, across a 64-slot tile at 60..67)."""
    model = load(files[kind, "q8_0"][0])
    for threads in (1, 2):
        model.set_threads(threads)
        assert_chain_bitwise(model, VOCAB, prefix_len=12, k=8)
        assert_chain_bitwise(model, VOCAB, prefix_len=60, k=8)
        assert_tree_bitwise(model, VOCAB, prefix_len=60)
        assert_batch_bitwise(model, VOCAB)


@pytest.mark.parametrize("kind", list(CASES))
def test_isas_give_scalar_bits(files, kind):
    path = files[kind, "q8_0"][0]
    ref = scenario(load(path, "scalar", threads=1), VOCAB)
    for isa in available_isas()[1:]:
        assert_same_bits(ref, scenario(load(path, isa), VOCAB), f"{kind} {isa}")


def _with(tmp_path, files, edit):
    """The gemma3 F32 file rewritten with ``edit(writer_fields, tensors)`` applied: (path)."""
    from gguf import GGUFReader, GGUFWriter

    src = GGUFReader(files["gemma3", "f32"][0])
    out = tmp_path / "edited.gguf"
    w = GGUFWriter(str(out), "gemma3")
    meta = {}
    for key, f in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        meta[key] = (f.types, f.contents())
    tensors = {t.name: t.data for t in src.tensors}
    edit(meta, tensors)
    for key, (types, value) in meta.items():
        from gguf import GGUFValueType

        if types[0] == GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, types[0])
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return out


def test_unimplemented_key_or_tensor_is_refused_before_weights(tmp_path, files):
    from gguf import GGUFValueType

    from verispec.models.gguf_config import open_gguf

    def softcap_attention(meta, tensors):
        meta["gemma3.attn_logit_softcapping"] = ([GGUFValueType.FLOAT32], 50.0)

    with pytest.raises(ModelError, match="'gemma3.attn_logit_softcapping', which verispec does not implement"):
        open_gguf(_with(tmp_path, files, softcap_attention))

    def scaled_rope(meta, tensors):
        meta["gemma3.rope.scaling.type"] = ([GGUFValueType.STRING], "yarn")

    with pytest.raises(ModelError, match="gemma3.rope.scaling.type = 'yarn', which verispec does not implement"):
        open_gguf(_with(tmp_path, files, scaled_rope))

    def bias(meta, tensors):
        tensors["blk.0.attn_q.bias"] = torch.zeros(128).numpy()

    with pytest.raises(ModelError, match="tensor blk.0.attn_q.bias, which verispec does not implement for gemma3"):
        open_gguf(_with(tmp_path, files, bias))


def test_cli_refuses_in_one_line(tmp_path, files):
    import subprocess
    import sys

    from gguf import GGUFValueType

    def moe(meta, tensors):
        meta["gemma3.expert_count"] = ([GGUFValueType.UINT32], 8)

    path = _with(tmp_path, files, moe)
    run = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "--model", str(path), "-n", "2", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "'gemma3.expert_count', which verispec does not implement" in run.stderr
    assert "Traceback" not in run.stderr


def test_native_runtime_refuses_what_it_does_not_implement(files):
    from verispec import load_model

    with pytest.raises(ModelError, match="Q/K norms, post-norms, GeGLU.*PyTorch runtime does not implement"):
        load_model(str(files["gemma3", "f32"][0]), backend="native")
