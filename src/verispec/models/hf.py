"""Backend over Hugging Face transformers causal LMs, through public interfaces only:
``model.get_decoder()`` forward with ``past_key_values`` (a ``DynamicCache``),
``position_ids`` and a prepared 4-D attention mask (which transformers passes through as
is), then ``model.get_output_embeddings()`` for logits. Rollback uses ``DynamicCache.crop``
and ``DynamicCache.update``."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from .base import BackendCaps, CausalLM, Exactness, ModelError, ModelInfo, ModelOutput, check_hidden_layers, model_bytes
from .formats import WeightFormat


def load_pretrained(path: str | Path, **kwargs) -> AutoModelForCausalLM:
    """``AutoModelForCausalLM.from_pretrained`` without transformers' "Loading weights" bar: a
    library call should not draw on its caller's terminal (the setting is restored after)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


class HFCache:
    """A ``DynamicCache`` seen through the verispec ``KVCache`` contract."""

    def __init__(self, capacity: int):
        self.dc = DynamicCache()
        self.capacity = capacity

    @property
    def length(self) -> int:
        return self.dc.get_seq_length()

    def truncate(self, new_length: int) -> int:
        removed = max(0, self.length - new_length)
        if removed:
            self.dc.crop(-removed)
        return removed

    def compact(self, src_slots: list[int], dst_start: int) -> None:
        if src_slots == list(range(dst_start, dst_start + len(src_slots))):
            self.truncate(dst_start + len(src_slots))  # already in place (a chain)
            return
        src = torch.tensor(src_slots, dtype=torch.long)
        kept = [(layer.keys[..., src, :], layer.values[..., src, :]) for layer in self.dc.layers]
        self.truncate(dst_start)
        for layer_idx, (k, v) in enumerate(kept):
            self.dc.update(k, v, layer_idx)


    def copy_prefix(self, src: "HFCache", length: int) -> None:
        """Make this (empty) cache hold ``src``'s first ``length`` slots (``Engine.fork``)."""
        if self.length != 0 or not 0 <= length <= src.length:
            raise ValueError(f"copy_prefix: need an empty cache and 0 <= length <= {src.length}")
        for layer_idx, layer in enumerate(src.dc.layers):
            self.dc.update(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone(), layer_idx)


class HFCausalLM(CausalLM):
    """Any transformers causal LM with RoPE-style ``position_ids`` (Llama family and most
    others). Loaded from a local directory; float32 or bfloat16."""

    description = "hf"
    formats = (WeightFormat.NONE,)  # transformers runs the checkpoint's weights unquantized

    def __init__(self, model: torch.nn.Module, name: str):
        self.model = model.eval()
        cfg = model.config
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) or cfg.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        param = next(model.parameters())
        self.info = ModelInfo(
            name=name,
            vocab_size=model.get_output_embeddings().weight.shape[0],
            max_length=int(getattr(cfg, "max_position_embeddings", 2048)),
            bos_token_id=cfg.bos_token_id,
            eos_token_ids=eos_ids,
            hidden_size=cfg.hidden_size,
            dtype=param.dtype,
            device=param.device,
        )
        self.exactness = Exactness(False, "transformers backend: its kernels are not batch-invariant (a "
                                          "multi-token verify forward may round differently from one-token "
                                          "decoding); for bit-exact output use --backend cpu (the compiled "
                                          "runtime, Llama-family models on CPU) or native (PyTorch, CUDA)")
        self.caps = BackendCaps(exactness=self.exactness, copy_prefix=True)  # one request per forward

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", name: str | None = None) -> "HFCausalLM":
        try:
            model = load_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
        except (OSError, ValueError) as e:
            raise ModelError(f"could not load a transformers model from {path}: {e}") from None
        return cls(model, name or str(path))

    @property
    def resident_bytes(self) -> int:
        return model_bytes(self.model)

    def new_cache(self, max_length: int | None = None) -> HFCache:
        return HFCache(max_length or self.info.max_length)

    def _mask(self, past: int, n: int, tree_mask: torch.Tensor) -> torch.Tensor:
        """[1, 1, n, past + n] additive mask: all cached slots visible, new tokens per tree."""
        visible = torch.cat(
            [torch.ones(n, past, dtype=torch.bool, device=tree_mask.device), tree_mask], dim=1
        )
        mask = torch.zeros(visible.shape, dtype=self.info.dtype, device=tree_mask.device)
        return mask.masked_fill(~visible, torch.finfo(self.info.dtype).min)[None, None]

    @torch.inference_mode()
    def forward(self, input_ids, positions, cache: HFCache, tree_mask=None, want_hidden=False,
                last_logits_only=False, hidden_layers: tuple[int, ...] = ()) -> ModelOutput:
        n_layers = self.model.config.num_hidden_layers
        hidden_layers = check_hidden_layers(hidden_layers, n_layers)
        if n_layers - 1 in hidden_layers:  # hidden_states[-1] is after the final norm, unlike the other backends
            raise ValueError(f"the transformers backend cannot return the last layer ({n_layers - 1}) before the "
                             "final norm; use the cpu or native backend")
        n, past = input_ids.shape[1], cache.length
        if past + n > cache.capacity:
            raise ValueError(f"sequence of {past + n} tokens exceeds the context of {cache.capacity}")
        mask = None if tree_mask is None else self._mask(past, n, tree_mask)
        out = self.model.get_decoder()(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache.dc,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
        )
        hidden = out.last_hidden_state  # [1, N, H], after the final norm
        # hidden_states[0] is the embedding output, [i + 1] layer i's output
        layers = torch.cat([out.hidden_states[i + 1] for i in hidden_layers], -1).float() if hidden_layers else None
        head_in = hidden[:, -1:] if last_logits_only else hidden
        logits = self.model.get_output_embeddings()(head_in).float()  # [1, N or 1, V]
        return ModelOutput(logits=logits, hidden=hidden if want_hidden else None, layers=layers)
