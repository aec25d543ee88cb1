"""Quantized layers of a prequantized checkpoint, deferred: a tensor-parallel rank reads only its rows
or columns of a layer's stored tensors, cut at the format's block or group boundaries, and converts
that slice with the checkpoint's own converter (checkpoint_formats).

A ``DeferredQuant`` stands for the converted weight ``X.weight`` [N, K] (an Fp8BlockWeight, an
Int4Weight or the exact float32 values); the shard plan narrows it like any ``LazyTensor``, and its
read narrows every stored part to match:

- FP8 blocks (``weight`` e4m3, ``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)]): any row range (read
  from the start of its first block, then the few rows before it dropped, as Fp8BlockWeight.take_rows
  does), columns on block edges (elsewhere refused, as today);
- compressed-tensors (``weight_packed`` / int8 ``weight``, ``weight_scale``, ``weight_zero_point``,
  ``weight_g_idx``), GPTQ (``qweight`` packed along K, ``qzeros`` and ``scales`` per group, ``g_idx``)
  and AWQ (``qweight`` and ``qzeros`` packed along N): rows on the packing of N (8 per int32 word
  where N is packed), columns on group edges. A ``g_idx`` (read whole, K entries) that is not the
  contiguous one keeps the columns whole; a GPTQ file with a zero point of 16 anywhere (float
  offsets for the whole weight) too.

Where a slice does not fall on those boundaries, the layer is read and converted whole, then sliced
(today's path for that tensor), and a log line says so. Either way the result equals the slice of the
whole layer converted at once. Routed experts are not deferred this way: a rank lists its own only.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from pagoda.kernels.fp8_block import Fp8BlockWeight
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.lazy_tensor import LazyTensor, read_now

log = logging.getLogger("pagoda.loader")

# An axis of a stored part: ("N" | "K", f): f values of the weight's dimension per element (packing);
# ("G", g): groups of g input channels (g 0: one group, the whole row); ("NB" | "KB", b): FP8 blocks.
Axis = tuple[str, int]


@dataclass(frozen=True)
class DeferredQuant(LazyTensor):
    """Layer ``key`` (``X.weight``) of a prequantized checkpoint: its stored ``parts`` (suffix,
    deferred tensor, one Axis per dimension), narrowed on read to ``bounds`` over [N, K]."""

    parts: tuple[tuple[str, LazyTensor, tuple[Axis, ...]], ...] = field(default=(), compare=False)
    method: str = ""  # checkpoint_formats' FP8_BLOCK | COMPRESSED | GPTQ | AWQ
    config: object = field(default=None, compare=False)  # CheckpointQuant (the CT Scheme for COMPRESSED)
    kind: str = ""  # what a read gives: "fp8_block", "int4" or "dense"
    group: int = 0  # INT4 group (FP8: the column block)
    as_float: bool = False  # read as float32 (the embeddings, LM head, router, MLA's kv_b_proj)
    cols_whole: str = ""  # why the columns cannot be cut before conversion ("": they can)

    @property
    def int4_group(self) -> int:
        return self.group if self.kind == "int4" and not self.as_float else 0

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The (rows, cols) block of a weight read as an Fp8BlockWeight."""
        if self.kind != "fp8_block" or self.as_float:
            return None
        return self.config.block

    @property
    def quantized_as(self) -> str | None:
        if self.as_float:
            return None
        return {"fp8_block": "fp8", "int4": "int4"}.get(self.kind)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the converted slice's canonical tensors (values, scales, zeros)."""
        n, k = self.shape
        if self.quantized_as == "fp8":
            bn, bk = self.config.block
            return n * k + -(-n // bn) * -(-k // bk) * 4 + n * 4  # values, block scales, row map
        if self.quantized_as == "int4":
            g = k // self.group
            return n * k // 2 + n * g * 4 + (n * g if not self.config_symmetric else 0)
        return n * k * 4

    @property
    def config_symmetric(self) -> bool:
        return bool(getattr(self.config, "symmetric", True))

    def resident_nbytes(self, compute: str) -> int:
        """An upper bound of Int4Weight.resident_nbytes (float32 scales and offsets)."""
        n, k = self.shape
        g = k // self.group
        if compute == "bf16":
            npad = -(-n // 16) * 16
            return npad * k // 2 + g * npad * 4
        return n * k // 2 + n * g * 8 + (n * g if not self.config_symmetric else 0)

    def __getitem__(self, key) -> DeferredQuant:
        out = super().__getitem__(key)
        c0, c1 = out.bounds[1]
        k = self.full_shape[1]
        unit = self.int4_group or (self.fp8_block or (0, 0))[1]
        if unit and (c0 % unit or (c1 % unit and c1 != k)):
            what = "INT4 groups" if self.int4_group else "FP8 blocks"
            raise ModelLoadError(
                f"a tensor-parallel column slice [{c0}, {c1}) splits the stored {what} of {unit} "
                f"columns: use a tensor-parallel degree that cuts at multiples of {unit}"
            )
        return out

    def _cut(self) -> list[tuple[int, int]] | None:
        """The [start, stop) of every stored part's dimensions for this slice (None: not on the
        boundaries); FP8 rows start at their first block."""
        (n0, n1), (k0, k1) = self.bounds
        n, k = self.full_shape
        if self.kind == "fp8_block":
            n0 -= n0 % self.config.block[0]
        if self.cols_whole and (k0, k1) != (0, k):
            return None
        cuts = []
        for _, lt, axes in self.parts:
            for d, (name, f) in enumerate(axes):
                lo, hi, whole = (n0, n1, n) if name[0] == "N" else (k0, k1, k)
                if name == "S" or (name == "G" and f == 0):  # a shape vector, or one group per row
                    cuts.append((0, lt.shape[d]))
                elif name == "NB":  # FP8 row blocks: any rows (the scale rows they touch)
                    cuts.append((lo // f, -(-hi // f)))
                elif lo % f or (hi % f and hi != whole):
                    return None
                else:
                    cuts.append((lo // f, -(-hi // f)))
        return cuts

    def read(self, handle=None) -> object:
        """This slice converted (an Fp8BlockWeight, an Int4Weight or float32 values)."""
        from pagoda.node_agent.models.parallel import take_cols, take_rows

        (n0, n1), (k0, k1) = self.bounds
        n, k = self.full_shape
        cuts = self._cut()
        if cuts is None:  # today's path: the whole layer converted, then sliced
            log.info(
                "%s: slice rows [%d, %d) columns [%d, %d) is not on the stored %s boundaries%s: read "
                "and converted whole, then sliced",
                self.key,
                n0,
                n1,
                k0,
                k1,
                self.method,
                f" ({self.cols_whole})" if self.cols_whole else "",
            )
            whole = dataclasses.replace(self, bounds=((0, n), (0, k)))
            w = whole.read(handle)
            if (n0, n1) != (0, n):
                w = take_rows(w, n0, n1)
            if (k0, k1) != (0, k):
                w = take_cols(w, k0, k1)
            return w
        stored: dict[str, torch.Tensor] = {}
        base = self.key.removesuffix(".weight")
        it = iter(cuts)
        for suffix, lt, axes in self.parts:
            part = lt[tuple(slice(*next(it)) for _ in axes)]
            t = part.read(handle) if part.file == self.file and handle is not None else read_now(part)
            if suffix.endswith("g_idx") and (k0, k1) != (0, k):
                t = t - k0 // (self.group or k)  # a contiguous g_idx: its slice counts groups from 0
            stored[f"{base}.{suffix}"] = t
        try:
            w = self._convert(stored, base, n1 - n0, k1 - k0, n0)
        except ValueError as exc:
            raise ModelLoadError(f"{self.file}: {exc}") from exc
        if self.as_float and not isinstance(w, torch.Tensor):
            w = w.dequantize()
        return w

    def _convert(self, stored: dict[str, torch.Tensor], base: str, n: int, k: int, n0: int):
        from pagoda.node_agent.models.checkpoint_formats import AWQ, COMPRESSED, FP8_BLOCK, GPTQ
        from pagoda.node_agent.models.compressed_tensors_format import convert_module
        from pagoda.node_agent.models.gptq_awq import awq_to_int4, gptq_to_int4

        if self.method == FP8_BLOCK:
            bn = self.config.block[0]
            w = Fp8BlockWeight.from_checkpoint(
                stored[f"{base}.weight"], stored[f"{base}.weight_scale_inv"], self.config.block, self.key
            )
            skip = n0 % bn  # rows read before the slice, from the start of its first block
            return w.take_rows(skip, skip + n) if skip else w
        if self.method == COMPRESSED:
            if f"{base}.weight_shape" in stored:
                stored[f"{base}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            return convert_module(stored, base, self.config)[0]
        q = self.config
        if self.method == GPTQ:
            return gptq_to_int4(stored, base, q.group_size, q.symmetric, q.zero_offset)[0]
        if self.method == AWQ:
            return awq_to_int4(stored, base, q.group_size)[0]
        raise ValueError(f"{self.key}: unknown checkpoint method {self.method!r}")


def defer_quantized_layers(weights: dict[str, LazyTensor], quant, dense_only: tuple[str, ...]) -> dict:
    """``weights`` with every quantized layer outside the routed experts replaced by one
    DeferredQuant under ``X.weight`` (its stored parts dropped); the rest as listed."""
    from pagoda.node_agent.models.checkpoint_formats import AWQ, COMPRESSED, FP8_BLOCK, GPTQ
    from pagoda.node_agent.models.compressed_tensors_format import group_runs, scheme_of

    out = dict(weights)
    for key, lt in weights.items():
        if ".mlp.experts." in key:
            continue
        if quant.method == FP8_BLOCK and key.endswith(".weight_scale_inv"):
            base = key.removesuffix(".weight_scale_inv")
            w = weights.get(base + ".weight")
            if w is None or w.dim() != 2:
                continue  # convert_checkpoint names what is wrong
            bn, bk = quant.block
            if tuple(lt.shape) != (-(-w.shape[0] // bn), -(-w.shape[1] // bk)):
                continue
            parts = (("weight", w, (("N", 1), ("K", 1))), ("weight_scale_inv", lt, (("NB", bn), ("KB", bk))))
            d = _deferred(base, w, parts, FP8_BLOCK, quant, "fp8_block", bk, dense_only)
        elif quant.method == COMPRESSED and (
            key.endswith(".weight_packed") or (key.endswith(".weight") and lt.stored_dtype == torch.int8)
        ):
            base = key.rsplit(".", 1)[0]
            try:
                s = scheme_of(base, quant.compressed)
            except ValueError:
                continue
            d = _compressed(base, weights, s, dense_only, group_runs, COMPRESSED)
        elif quant.method in (GPTQ, AWQ) and key.endswith(".qweight"):
            d = _gptq_awq(key.removesuffix(".qweight"), weights, quant, dense_only)
        else:
            continue
        if d is None:
            continue
        for suffix, _, _ in d.parts:
            out.pop(f"{d.key.removesuffix('.weight')}.{suffix}", None)
        out[d.key] = d
    return out


def _deferred(
    base: str,
    values: LazyTensor,
    parts: tuple,
    method: str,
    config: object,
    kind: str,
    group: int,
    dense_only: tuple[str, ...],
    n_k: tuple[int, int] | None = None,
    cols_whole: str = "",
) -> DeferredQuant:
    n, k = n_k or tuple(values.shape)
    name = base + ".weight"
    return DeferredQuant(
        values.file,
        name,
        torch.float32,
        ((0, n), (0, k)),
        True,
        (n, k),
        parts,
        method,
        config,
        kind,
        group,
        name.endswith(dense_only),
        cols_whole,
    )


def _compressed(base: str, weights: dict, s, dense_only, group_runs, method: str) -> DeferredQuant | None:
    """A compressed-tensors module's parts and axes (None: left to the whole converter)."""
    scale, zp, gidx = (
        weights.get(f"{base}.{p}") for p in ("weight_scale", "weight_zero_point", "weight_g_idx")
    )
    if scale is None or scale.dim() != 2:
        return None
    f = 32 // s.bits
    g = s.group_size
    if s.fmt == "pack-quantized":
        packed, shape = weights.get(f"{base}.weight_packed"), weights.get(f"{base}.weight_shape")
        if packed is None or shape is None:
            return None
        dims = [int(d) for d in read_now(shape).reshape(-1).tolist()]
        if len(dims) != 2:
            return None
        n, k = dims
        parts = [("weight_packed", packed, (("N", 1), ("K", f))), ("weight_shape", shape, (("S", 0),))]
    else:
        values = weights.get(f"{base}.weight")
        n, k = values.shape
        parts = [("weight", values, (("N", 1), ("K", 1)))]
    parts.append(("weight_scale", scale, (("N", 1), ("G", g))))
    if zp is not None:
        packed_zp = zp.stored_dtype == torch.int32
        parts.append(("weight_zero_point", zp, (("N", f if packed_zp else 1), ("G", g))))
    kind, why = ("int4" if s.bits == 4 else "dense"), ""
    if gidx is not None:
        try:
            runs, _ = group_runs(f"{base}.weight_g_idx", read_now(gidx), k, g or k)
        except ValueError:
            return None
        parts.append(("weight_g_idx", gidx, (("K", 1),)))
        if runs != "trivial":
            why = f"its g_idx is {'act-ordered' if runs == 'scatter' else 'in permuted runs'}"
            kind = "dense" if runs == "scatter" else kind
    return _deferred(base, parts[0][1], tuple(parts), method, s, kind, g or k, dense_only, (n, k), why)


def _gptq_awq(base: str, weights: dict, quant, dense_only) -> DeferredQuant | None:
    from pagoda.node_agent.models.checkpoint_formats import GPTQ
    from pagoda.node_agent.models.gptq_awq import _unpack_words

    qweight, qzeros, scales = (weights.get(f"{base}.{p}") for p in ("qweight", "qzeros", "scales"))
    if qzeros is None or scales is None or scales.dim() != 2 or qweight.dim() != 2:
        return None
    g = quant.group_size
    gptq = quant.method == GPTQ
    n, k = scales.shape[1], qweight.shape[0] * (8 if gptq else 1)
    why = ""
    parts = [
        ("qweight", qweight, (("K", 8), ("N", 1)) if gptq else (("K", 1), ("N", 8))),
        ("qzeros", qzeros, (("G", g), ("N", 8))),
        ("scales", scales, (("G", g), ("N", 1))),
    ]
    gidx = weights.get(f"{base}.g_idx")
    if gidx is not None:
        idx = read_now(gidx).long()
        if idx.dim() != 1 or idx.numel() != k or not torch.equal(idx, torch.arange(k) // g):
            why = "its g_idx is not the contiguous one"
        parts.append(("g_idx", gidx, (("K", 1),)))
    if gptq and not quant.symmetric:  # a zero of 16 anywhere gives the whole weight float offsets
        zeros = _unpack_words(read_now(qzeros)) + quant.zero_offset
        if int(zeros.max()) > 15:
            log.info(
                "%s: a zero point of 16 (float offsets for the whole weight): read and converted whole", base
            )
            return None
    return _deferred(base, qweight, tuple(parts), quant.method, quant, "int4", g, dense_only, (n, k), why)
