"""Deferred checkpoint tensors: a safetensors tensor named by file and key, narrowed by the shard
plan's slicing before any byte of it is read.

A ``LazyTensor`` has the shape, dimension count and indexing the sharding code uses (rows, columns,
a range of stacked experts); ``materialize`` then reads every deferred slice, one shard file at a
time, through safetensors' memory-mapped lazy slices (``safe_open(...).get_slice(name)[...]``), and
converts each slice on its own. A rank thus reads the bytes it holds and never a whole checkpoint;
the largest transient is one tensor slice in its stored dtype beside its float32 copy.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("pagoda.loader")

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class LazyTensor:
    """``key`` of safetensors file ``file``, restricted to ``bounds`` ((start, stop) per dimension);
    ``to_float``: converted to float32 when read."""

    file: str
    key: str
    stored_dtype: torch.dtype
    bounds: tuple[tuple[int, int], ...]
    to_float: bool = True
    full_shape: tuple[int, ...] = field(default=(), compare=False)

    @classmethod
    def whole(cls, file: str, key: str, shape: Iterable[int], dtype: str, to_float: bool) -> LazyTensor:
        """The whole tensor ``key`` (shape and safetensors dtype name from the file's header)."""
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {key} has dtype {dtype}, which is not supported")
        dims = tuple(int(d) for d in shape)
        return cls(file, key, SAFETENSORS_DTYPES[dtype], tuple((0, d) for d in dims), to_float, dims)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for a, b in self.bounds)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype ``materialize`` returns."""
        if self.to_float and self.stored_dtype.is_floating_point:
            return torch.float32
        return self.stored_dtype

    def dim(self) -> int:
        return len(self.bounds)

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of the read slice in its materialized dtype."""
        return self.numel() * torch.empty((), dtype=self.dtype).element_size()

    def contiguous(self) -> LazyTensor:
        return self

    def float(self) -> LazyTensor:
        """The same slice, to be read as float32."""
        return dataclasses.replace(self, to_float=True)

    def __getitem__(self, key) -> LazyTensor:
        """A narrower deferred slice: basic slices (step 1) over the leading dimensions."""
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > len(self.bounds):
            raise IndexError(f"{self.key}: {len(key)} indices for {len(self.bounds)} dimensions")
        bounds = list(self.bounds)
        for d, k in enumerate(key):
            if not isinstance(k, slice):
                raise TypeError(f"{self.key}: a deferred tensor takes slices only, got {k!r}")
            a, b = bounds[d]
            start, stop, step = k.indices(b - a)
            if step != 1:
                raise ValueError(f"{self.key}: a deferred slice takes step 1, got {step}")
            bounds[d] = (a + start, a + max(start, stop))
        return dataclasses.replace(self, bounds=tuple(bounds))

    @property
    def int4_group(self) -> int:
        """The INT4 group of a tensor read as an Int4Weight (a column slice keeps it whole); 0: none."""
        return 0

    @property
    def quantized_as(self) -> str | None:
        """The prequantized format a read gives ("int4", "fp8"), None for a float tensor."""
        return None

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The (rows, cols) block of a tensor read as an Fp8BlockWeight; None: none."""
        return None

    def open(self):
        """A context manager giving the handle ``read`` takes (a ``safe_open`` of ``file``)."""
        from safetensors import safe_open

        return safe_open(self.file, framework="pt")

    def read(self, handle) -> torch.Tensor:
        """This slice from an open ``safe_open`` handle of ``file``, converted."""
        if self.bounds and self.numel() == 0:  # e.g. a last rank's vocab rows past the end
            return torch.empty(tuple(self.shape), dtype=self.dtype)
        if not self.bounds:
            t = handle.get_tensor(self.key)
        elif all(b == (0, d) for b, d in zip(self.bounds, self.full_shape, strict=True)):
            t = handle.get_tensor(self.key)
        else:
            t = handle.get_slice(self.key)[tuple(slice(a, b) for a, b in self.bounds)]
        if self.to_float and t.is_floating_point() and t.dtype != torch.float32:
            t = t.float()
        return t.contiguous()


def deferred(w: object) -> list[LazyTensor]:
    """The deferred tensors ``w`` holds (itself, or a wrapper's ``weight``)."""
    if isinstance(w, LazyTensor):
        return [w]
    inner = getattr(w, "weight", None)
    return [inner] if isinstance(inner, LazyTensor) else []


def read_now(w: LazyTensor) -> torch.Tensor:
    """One deferred tensor read at once (opens its file for this read)."""
    with w.open() as h:
        return w.read(h)


def materialize(
    weights: dict[str, object], progress: Callable[[str], None] | None = None
) -> dict[str, object]:
    """``weights`` with every deferred tensor read (also a wrapper's deferred ``weight``, e.g. a
    ColumnShard): one shard file open at a time, tensor by tensor, in the file's order. Other values
    pass through. One log line per shard file (``progress`` gets it too)."""
    by_file: dict[str, list[str]] = {}
    opener: dict[str, LazyTensor] = {}
    for name, w in weights.items():
        for lt in deferred(w):
            by_file.setdefault(lt.file, []).append(name)
            opener.setdefault(lt.file, lt)
    out = dict(weights)
    for n, (file, names) in enumerate(sorted(by_file.items()), 1):
        t0, nbytes = time.perf_counter(), 0
        with opener[file].open() as h:
            for name in names:
                w = out[name]
                if isinstance(w, LazyTensor):
                    out[name] = t = w.read(h)
                else:  # a wrapper: read its weight in place
                    w.weight = t = w.weight.read(h)  # type: ignore[attr-defined]
                nbytes += int(t.nbytes)
        line = (
            f"shard {n}/{len(by_file)} {file.rsplit('/', 1)[-1]}: {len(names)} tensors, "
            f"{nbytes / 2**20:.1f} MiB held, {time.perf_counter() - t0:.2f} s"
        )
        log.info("%s", line)
        if progress is not None:
            progress(line)
    return out
