"""Weights whose layout differs from their GGUF file's, written once per file and memory-mapped after.

Two kinds, each in a cache file of its own under <cache root>/repacked, keyed by the GGUF's path,
size and modification time, `LAYOUT_VERSION` and the tensor-parallel rank:
- stored (`.kvs`): tensors held as the file's own blocks (`StoredWeight`) where kvserve's layout is
  not the file's: llama-family Q/K rows un-permuted, a rank's column slice. Written tensor by
  tensor as the loader makes them (`save_stored` takes an iterator), so a first load holds one
  such tensor at a time, never the model twice; the rest of the weights are views of the GGUF.
- repacked (`.kvq`): weights of types the stored-block kernels do not run, repacked for the older
  kernel (model/quantized.py: seconds per GB, and in anonymous memory a private copy per process).

Every later load maps the file read-only-shared (copy-on-write): start-up reads no GGUF block
for them, the weights are page-cache pages that processes on one host share, and the kernels
read them straight from the mapping. Its pages are mapped at load, but for the experts of a
mixture of experts, which fault in when a token first picks them.

File layout: 8 bytes magic, the JSON header's offset and length (8 bytes little-endian each),
the tensors, each at an offset aligned to 64 bytes, then the header (the entries' names, their
metadata and each tensor's offset/shape/dtype): written last, so tensors go out as they come.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Iterable

import torch

from kvserve.model.gguf_file import file_identity, populate
from kvserve.model.quantized import QuantizedWeight
from kvserve.paths import cache_root

logger = logging.getLogger(__name__)

# Bump whenever quantized.py's kernel layout, stored_weight.py's, or the loader's repacking (row
# order, widening, which tensors are copies) changes.
LAYOUT_VERSION = 2
_MAGIC = b"KVQPACK2"
_PREAMBLE = struct.Struct("<8sQQ")
_ALIGN = 64
_DTYPES = {"uint8": torch.uint8, "float32": torch.float32}
_SUFFIXES = {"repacked": ".kvq", "stored": ".kvs"}


def cache_path(model_path: str, tp_rank: int = 0, tp_size: int = 1, kind: str = "repacked",
               stored_types: Iterable[str] = ()) -> str:
    """Where the `kind` ("repacked" or "stored") weights of `model_path` (this rank's shard) are
    cached, given the GGUF types held as stored (the others are repacked)."""
    path, size, mtime_ns = file_identity(model_path)
    stored = ",".join(sorted(stored_types))
    key = hashlib.sha256(f"{path}|{size}|{mtime_ns}|{LAYOUT_VERSION}|{tp_rank}/{tp_size}|{stored}".encode()).hexdigest()
    stem = os.path.basename(path).removesuffix(".gguf")
    return os.path.join(cache_dir(), f"{stem}.{key[:16]}{_SUFFIXES[kind]}")


def cache_dir() -> str:
    return os.path.join(cache_root(), "repacked")


class _Writer:
    """Writes a cache file's tensors as they come into a staged file; `commit` adds the header
    and renames it into place (atomically); a writer left uncommitted removes its file."""

    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        directory = os.path.dirname(path)
        _evict_stale(directory)
        os.makedirs(directory, exist_ok=True)
        handle, self.staged = tempfile.mkstemp(suffix=".partial", dir=directory)
        self.out = os.fdopen(handle, "wb")
        self.entries: dict[str, dict] = {}
        self.offset = _ALIGN  # the data start, past the preamble

    def add(self, name: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        specs = {}
        for field, tensor in tensors.items():
            self.offset = -(-self.offset // _ALIGN) * _ALIGN
            specs[field] = {"offset": self.offset, "shape": list(tensor.shape),
                            "dtype": str(tensor.dtype).removeprefix("torch.")}
            self.out.seek(self.offset)
            self.out.write(memoryview(tensor.contiguous().numpy()).cast("B"))
            self.offset += tensor.numel() * tensor.element_size()
        self.entries[name] = {**meta, "tensors": specs}

    def commit(self) -> None:
        source_path, size, mtime_ns = file_identity(self.source)
        header = json.dumps({"layout_version": LAYOUT_VERSION, "weights": self.entries,
                             "source": {"path": source_path, "size": size, "mtime_ns": mtime_ns}}).encode()
        header_offset = -(-self.offset // _ALIGN) * _ALIGN
        self.out.seek(header_offset)
        self.out.write(header)
        self.out.seek(0)
        self.out.write(_PREAMBLE.pack(_MAGIC, header_offset, len(header)))
        self.out.close()
        os.chmod(self.staged, 0o644)
        os.replace(self.staged, self.path)

    def __enter__(self) -> "_Writer":
        return self

    def __exit__(self, *exc) -> None:
        if not self.out.closed:
            self.out.close()
        if os.path.exists(self.staged):
            os.remove(self.staged)


def save(path: str, weights: dict[str, QuantizedWeight], source: str) -> None:
    """Write `weights` (module name -> weight), repacked from the GGUF file `source`, to `path`
    atomically; entries of other GGUF files that changed or are gone are deleted first."""
    with _Writer(path, source) as writer:
        for name, weight in weights.items():
            writer.add(name, {"bits": weight.bits, "in_features": weight.in_features,
                              "source_type": weight.source_type},
                       {"qs": weight.qs, "d": weight.d, "m": weight.m})
        writer.commit()


def save_stored(path: str, weights: Iterable, source: str) -> int:
    """Write the (HF name, StoredWeight) pairs `weights` yields, each as it comes (so that only one
    is held at a time where the iterator makes them one by one), to `path` atomically (see
    `save`); returns how many."""
    with _Writer(path, source) as writer:
        for name, weight in weights:
            writer.add(name, {"ggml_type": weight.ggml_type, "type_name": weight.type_name,
                              "in_features": weight.in_features}, {"blocks": weight.blocks})
            del weight  # not held while the iterator makes the next
        writer.commit()
        return len(writer.entries)


def load(path: str) -> dict[str, QuantizedWeight] | None:
    """The weights `save` wrote at `path`, as views of a private (copy-on-write) mapping of the
    file; None when there is no such file or it is not one this version wrote."""
    def weight(entry: dict, tensors: dict) -> QuantizedWeight:
        return QuantizedWeight(tensors["qs"], tensors["d"], tensors["m"], entry["bits"], entry["in_features"],
                               entry["source_type"])
    return _load_entries(path, weight)


def load_stored(path: str) -> dict | None:
    """The StoredWeights `save_stored` wrote at `path`, by HF name, as `load` maps them."""
    from kvserve.model.stored_weight import StoredWeight

    def weight(entry: dict, tensors: dict) -> StoredWeight:
        return StoredWeight(blocks=tensors["blocks"], ggml_type=entry["ggml_type"], type_name=entry["type_name"],
                            in_features=entry["in_features"])
    return _load_entries(path, weight)


def _load_entries(path: str, make) -> dict | None:
    try:
        with open(path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    header = _read_header(mapping)
    if not header or header.get("layout_version") != LAYOUT_VERSION:
        logger.info("ignoring repacked-weight cache %s (not of layout version %d)", path, LAYOUT_VERSION)
        return None
    weights = {}
    try:
        for name, entry in header["weights"].items():
            tensors = {field: _view(mapping, spec) for field, spec in entry["tensors"].items()}
            weights[name] = make(entry, tensors)
        for start, end in _eager_ranges(header):
            populate(mapping, start, min(end, len(mapping)) - start)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:  # a damaged (e.g. truncated) file
        logger.warning("ignoring damaged repacked-weight cache %s (%s)", path, error)
        return None
    return weights


def _eager_ranges(header: dict) -> list[tuple[int, int]]:
    """(start, end) byte ranges, page-aligned and merged, of every weight but the experts of a
    mixture of experts: those are left to fault in when a token first picks them, so an expert
    no token picks is never paged in."""
    page = mmap.PAGESIZE
    ranges = []
    for name, entry in header["weights"].items():
        if ".experts." in name:
            continue
        for spec in entry["tensors"].values():
            nbytes = _DTYPES[spec["dtype"]].itemsize * math.prod(spec["shape"])
            ranges.append((spec["offset"] // page * page, -(-(spec["offset"] + nbytes) // page) * page))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _read_header(buffer) -> dict | None:
    """The header of a cache file (a buffer over all of it); None if it is not one."""
    try:
        magic, offset, length = _PREAMBLE.unpack_from(buffer, 0)
        if magic != _MAGIC or offset + length > len(buffer):
            return None
        return json.loads(bytes(buffer[offset:offset + length]))
    except (struct.error, ValueError):
        return None


def _read_file_header(path: str) -> dict | None:
    """`_read_header` of the file at `path`, reading only the preamble and the header."""
    with open(path, "rb") as f:
        preamble = f.read(_PREAMBLE.size)
        if len(preamble) != _PREAMBLE.size or preamble[:8] != _MAGIC:
            return None
        _, offset, length = _PREAMBLE.unpack(preamble)
        if offset + length > os.fstat(f.fileno()).st_size:
            return None
        f.seek(offset)
        try:
            return json.loads(f.read(length))
        except ValueError:
            return None


def _evict_stale(directory: str) -> None:
    """Delete the cache files whose GGUF is gone or changed, or of another layout version."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not name.endswith(tuple(_SUFFIXES.values())):
            continue
        try:
            header = _read_file_header(path)
            source = (header or {}).get("source", {})
            stale = (header is None or header.get("layout_version") != LAYOUT_VERSION
                     or not os.path.isfile(source.get("path", ""))
                     or file_identity(source["path"])[1:] != (source.get("size"), source.get("mtime_ns")))
            if stale:
                os.remove(path)
        except OSError:
            continue


def _view(mapping: mmap.mmap, spec: dict) -> torch.Tensor:
    dtype = _DTYPES[spec["dtype"]]
    count = 1
    for dim in spec["shape"]:
        count *= dim
    # The tensor keeps the mapping alive (torch holds the buffer's exporter).
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=spec["offset"]).view(spec["shape"])
