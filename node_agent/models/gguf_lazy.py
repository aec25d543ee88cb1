"""Deferred GGUF tensors: a tensor-parallel rank dequantizes only the part of a GGUF file it holds.

The gguf package's reader memory-maps the file; a ``GgufTensor`` names one tensor's memmapped
array (one expert's slab of a stacked ``ffn_*_exps`` tensor, so another rank's experts are never
listed) and is narrowed by the shard plan like a safetensors ``LazyTensor``. Reading it cuts the
quantized array before ``gguf.dequantize``:

- leading dimensions (output rows, vocab rows, heads, experts) always: a GGUF row is whole blocks;
- the inner dimension (a row-parallel weight's columns) at the type's block boundaries (32 values,
  256 for K-quants). A column range that does not start and end on a block boundary dequantizes
  whole rows, then slices them (logged once per tensor);
- Q4_0 / Q4_1 linear weights of a dense block stay INT4 codes (``gguf_blocks.int4_from_gguf``):
  their columns are cut only at the 32-weight groups, as an Int4Weight's are.

Every value equals the slice of the whole tensor dequantized at once: ggml blocks decode on their
own. ``deferred_gguf_weights`` lists a file's tensors this way under Hugging Face names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.gguf_blocks import (
    BLOCK,
    EXACT_INT4_TYPES,
    int4_from_gguf,
    permute_rows,
    unpermute_rope,
)
from pagoda.node_agent.models.gguf_names import (
    GGUF_EXPERT_STACKS,
    GGUF_MOE_LAYER_NAMES,
    gguf_to_hf_name,
    join_kv_b,
)
from pagoda.node_agent.models.lazy_tensor import LazyTensor

log = logging.getLogger("pagoda.loader")


@dataclass(frozen=True)
class GgufTensor(LazyTensor):
    """A GGUF tensor (``data``: its memmapped array, quantized rows in bytes) restricted to
    ``bounds`` over its Hugging Face shape, read as float32 (an Int4Weight when ``int4``).
    ``head_rows``: rows per head of llama.cpp's q/k RoPE permutation, undone on read."""

    data: np.ndarray | None = field(default=None, compare=False, repr=False)
    qtype: str = "F32"
    head_rows: int = 0
    int4: bool = False

    @property
    def int4_group(self) -> int:
        return BLOCK if self.int4 else 0

    def open(self):
        return contextlib.nullcontext()  # the reader's memory map is the handle

    def __getitem__(self, key) -> GgufTensor:
        out = super().__getitem__(key)
        (r0, r1), (c0, c1) = (out.bounds[0], out.bounds[-1]) if out.bounds else ((0, 0), (0, 0))
        if out.head_rows and (r0 % out.head_rows or r1 % out.head_rows):
            raise ModelLoadError(f"{self.key}: rows [{r0}, {r1}) cut a head of {out.head_rows} rows")
        if out.int4 and (c0 % BLOCK or c1 % BLOCK):
            raise ModelLoadError(
                f"a tensor-parallel column slice [{c0}, {c1}) splits the stored INT4 groups of {BLOCK}: "
                f"use a tensor-parallel degree that cuts at multiples of {BLOCK}, or a checkpoint "
                "quantized with smaller groups"
            )
        return out

    def raw(self) -> tuple[np.ndarray, int]:
        """The stored array of this slice (whole blocks of the inner dimension) and the offset of
        the slice's first column in it (0 unless the columns are off the block boundaries)."""
        import gguf

        lead = tuple(slice(a, b) for a, b in self.bounds[:-1])
        c0, c1 = self.bounds[-1]
        if self.data.dtype != np.uint8:  # F32 / F16: one element per value
            return self.data[(*lead, slice(c0, c1))], 0
        bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.qtype]]
        if c0 % bs == 0 and c1 % bs == 0:
            return self.data[(*lead, slice(c0 // bs * ts, c1 // bs * ts))], 0
        log.info(
            "%s: columns [%d, %d) are not on %s's %d-value block boundaries: whole rows "
            "dequantized, then sliced",
            self.key,
            c0,
            c1,
            self.qtype,
            bs,
        )
        return self.data[lead], c0

    def read(self, handle=None):
        """This slice dequantized to float32 (or kept as INT4 codes), q/k rows un-permuted."""
        import gguf

        if self.numel() == 0:  # e.g. a last rank's vocab rows past the end
            return torch.empty(tuple(self.shape), dtype=torch.float32)
        raw, off = self.raw()
        rows, cols = (self.shape[0], self.shape[-1]) if self.dim() == 2 else (1, self.shape[-1])
        if self.int4:
            w = int4_from_gguf(self.qtype, raw, rows, cols)
            if self.head_rows:
                order = unpermute_rope(np.arange(rows), rows // self.head_rows)
                w = permute_rows(w, torch.from_numpy(order.copy()))
            return w
        try:
            arr = gguf.dequantize(raw, gguf.GGMLQuantizationType[self.qtype])
        except Exception as exc:
            raise ModelLoadError(
                f"{self.file}: cannot decode tensor {self.key} ({self.qtype}): {exc}"
            ) from exc
        arr = np.asarray(arr, dtype=np.float32)[..., off : off + cols].reshape(tuple(self.shape))
        if self.head_rows:
            arr = unpermute_rope(arr, rows // self.head_rows)
        return torch.from_numpy(np.array(arr, copy=True))


@dataclass(frozen=True)
class GgufKvB(LazyTensor):
    """MLA's kv_b_proj [H*(nope+v), kv_lora_rank] joined from the converter's per-head ``attn_k_b``
    [H, rank, nope] and ``attn_v_b`` [H, v, rank]: a row slice of whole heads reads those heads."""

    k_b: GgufTensor | None = None
    v_b: GgufTensor | None = None
    mla: object = field(default=None, compare=False)

    def open(self):
        return contextlib.nullcontext()

    def __getitem__(self, key) -> GgufKvB:
        out = super().__getitem__(key)
        (r0, r1), cols = out.bounds
        per = self.mla.qk_nope_head_dim + self.mla.v_head_dim
        if r0 % per or r1 % per or cols != (0, self.mla.kv_lora_rank):
            raise ModelLoadError(f"{self.key}: a slice {out.bounds} is not whole heads of {per} rows")
        h0, h1 = r0 // per, r1 // per
        return dataclasses.replace(out, k_b=self.k_b[h0:h1], v_b=self.v_b[h0:h1])

    def read(self, handle=None) -> torch.Tensor:
        return join_kv_b(self.k_b.read(), self.v_b.read(), self.mla, f"{self.file}: {self.key}")


def _tensor(path: str, key: str, data: np.ndarray, qtype: str, dims: tuple[int, ...], **kw) -> GgufTensor:
    return GgufTensor(path, key, torch.float32, tuple((0, d) for d in dims), True, dims, data, qtype, **kw)


def deferred_gguf_weights(
    path: str,
    tensors: dict,
    fam: str,
    heads: int,
    kv_heads: int,
    n_layers: int,
    mla,
    experts: tuple[int, int] | None,
) -> tuple[dict[str, LazyTensor], set[str]]:
    """Hugging Face name -> deferred tensor for every GGUF tensor the engine uses (of a stacked
    expert tensor, only the experts in ``experts``), and the block types an INT4 decode phase
    re-quantizes. The same names, shapes and values as the loader's whole decode."""
    weights: dict[str, LazyTensor] = {}
    kv_b: dict[str, dict[str, GgufTensor]] = {}
    requantized: set[str] = set()
    for name, t in tensors.items():
        block = name.split(".")[1] if name.startswith("blk.") else ""
        if block.isdigit() and int(block) >= n_layers:
            continue
        qtype = t.tensor_type.name
        dims = tuple(int(d) for d in reversed(t.shape))
        hf = gguf_to_hf_name(name)
        if hf is not None and hf.endswith("_proj.weight") and qtype not in ("F32", "F16", "BF16"):
            exact = mla is None and qtype in EXACT_INT4_TYPES and ".shared_expert" not in hf
            if not exact:
                requantized.add(qtype)
        else:
            exact = False
        head_rows = 0
        if fam in ("llama", "mistral") and name.endswith(("attn_q.weight", "attn_k.weight")):
            head_rows = dims[0] // (heads if name.endswith("attn_q.weight") else kv_heads)
        if mla is not None and name.endswith((".attn_k_b.weight", ".attn_v_b.weight")):
            kv_b.setdefault(block, {})[name.split(".")[2]] = _tensor(path, name, t.data, qtype, dims)
            continue
        moe = _moe_names(name, dims, experts)
        if moe is not None:
            for hf_name, e in moe:
                if e is None:
                    weights[hf_name] = _tensor(path, name, t.data, qtype, dims)
                else:
                    weights[hf_name] = _tensor(path, f"{name}[{e}]", t.data[e], qtype, dims[1:])
            continue
        if hf is None:
            continue
        weights[hf] = _tensor(path, name, t.data, qtype, dims, head_rows=head_rows, int4=exact)
    for block, parts in kv_b.items():
        if set(parts) != {"attn_k_b", "attn_v_b"}:
            raise ModelLoadError(
                f"{path}: blk.{block} has {sorted(parts)} but needs both attn_k_b and attn_v_b"
            )
        k_b, v_b = parts["attn_k_b"], parts["attn_v_b"]
        rows = k_b.shape[0] * (mla.qk_nope_head_dim + mla.v_head_dim)
        dims = (rows, mla.kv_lora_rank)
        name = f"model.layers.{block}.self_attn.kv_b_proj.weight"
        if k_b.dim() != 3 or v_b.dim() != 3:
            raise ModelLoadError(
                f"{path}: blk.{block}: attn_k_b {tuple(k_b.shape)} / attn_v_b {tuple(v_b.shape)} are not "
                "[heads, ...] stacks"
            )
        weights[name] = GgufKvB(
            path,
            f"blk.{block}.attn_k_b+attn_v_b",
            torch.float32,
            ((0, rows), (0, dims[1])),
            True,
            dims,
            k_b,
            v_b,
            mla,
        )
    return weights, requantized


def _moe_names(
    name: str, dims: tuple[int, ...], experts: tuple[int, int] | None
) -> list[tuple[str, int | None]] | None:
    """(HF name, expert index or None) of a per-layer MoE tensor, None for any other tensor."""
    if not name.startswith("blk."):
        return None
    _, idx, rest = name.split(".", 2)
    base, _, suffix = rest.partition(".")
    p = f"model.layers.{idx}."
    if base in GGUF_MOE_LAYER_NAMES:
        return [(f"{p}{GGUF_MOE_LAYER_NAMES[base]}.{suffix}", None)]
    if base == "exp_probs_b":
        return [(f"{p}mlp.gate.e_score_correction_bias", None)]
    if base not in GGUF_EXPERT_STACKS:
        return None
    if len(dims) != 3:
        raise ModelLoadError(f"blk.{idx}.{base} must be a stacked [experts, out, in] tensor, got {dims}")
    e0, e1 = experts if experts is not None else (0, dims[0])
    proj = GGUF_EXPERT_STACKS[base]
    return [(f"{p}mlp.experts.{e}.{proj}.{suffix}", e) for e in range(e0, min(e1, dims[0]))]
