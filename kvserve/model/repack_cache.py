"""The quantized weights in the kernels' layout, written once per GGUF file and memory-mapped after.

Repacking a GGUF's blocks for the kernels (model/quantized.py) costs seconds per GB and, held in
anonymous memory, a private copy per process. So the loader writes the repacked weights of each
file (and tensor-parallel rank) to one cache file under <cache root>/repacked, keyed by the GGUF's
path, size and modification time and `LAYOUT_VERSION`, and every later load maps that file
read-only-shared (copy-on-write): start-up reads no GGUF block, the weights are page-cache pages
that processes on one host share, and the kernel stream reads them straight from the mapping.

File layout: 8 bytes magic, 8 bytes little-endian header length, a JSON header (the weights' module
names, bits, widths, GGUF type names and each tensor's offset/shape/dtype), then the tensors, each
at an offset aligned to 64 bytes.
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

import torch

from kvserve.model.gguf_file import file_identity
from kvserve.model.quantized import QuantizedWeight
from kvserve.paths import cache_root

logger = logging.getLogger(__name__)

# Bump whenever quantized.py's kernel layout or the loader's repacking (row order, widening) changes.
LAYOUT_VERSION = 1
_MAGIC = b"KVQPACK1"
_ALIGN = 64
_DTYPES = {"uint8": torch.uint8, "float32": torch.float32}


def cache_path(model_path: str, tp_rank: int = 0, tp_size: int = 1) -> str:
    """Where the repacked weights of `model_path` (this rank's shard) are cached."""
    path, size, mtime_ns = file_identity(model_path)
    key = hashlib.sha256(f"{path}|{size}|{mtime_ns}|{LAYOUT_VERSION}|{tp_rank}/{tp_size}".encode()).hexdigest()
    stem = os.path.basename(path).removesuffix(".gguf")
    return os.path.join(cache_dir(), f"{stem}.{key[:16]}.kvq")


def cache_dir() -> str:
    return os.path.join(cache_root(), "repacked")


def save(path: str, weights: dict[str, QuantizedWeight], source: str) -> None:
    """Write `weights` (module name -> weight), repacked from the GGUF file `source`, to `path`
    atomically; entries of other GGUF files that changed or are gone are deleted first."""
    _evict_stale(os.path.dirname(path))
    entries, offset = {}, 0
    for name, weight in weights.items():
        tensors = {}
        for field in ("qs", "d", "m"):
            tensor = getattr(weight, field)
            offset = -(-offset // _ALIGN) * _ALIGN
            tensors[field] = {"offset": offset, "shape": list(tensor.shape),
                              "dtype": str(tensor.dtype).removeprefix("torch.")}
            offset += tensor.numel() * tensor.element_size()
        entries[name] = {"bits": weight.bits, "in_features": weight.in_features,
                         "source_type": weight.source_type, "tensors": tensors}
    source_path, size, mtime_ns = file_identity(source)
    header = json.dumps({"layout_version": LAYOUT_VERSION, "weights": entries,
                         "source": {"path": source_path, "size": size, "mtime_ns": mtime_ns}}).encode()
    data_start = -(-(16 + len(header)) // _ALIGN) * _ALIGN
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    handle, staged = tempfile.mkstemp(suffix=".partial", dir=directory)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(_MAGIC + struct.pack("<Q", len(header)) + header)
            for name, weight in weights.items():
                for field, spec in entries[name]["tensors"].items():
                    out.seek(data_start + spec["offset"])
                    out.write(memoryview(getattr(weight, field).contiguous().numpy()).cast("B"))
        os.chmod(staged, 0o644)
        os.replace(staged, path)
    finally:
        if os.path.exists(staged):
            os.remove(staged)


def load(path: str) -> dict[str, QuantizedWeight] | None:
    """The weights saved at `path` as views of a private (copy-on-write) mapping of the file; None
    when there is no such file or it is not one this version wrote."""
    try:
        with open(path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    header, data_start = _read_header(mapping)
    if not header or header.get("layout_version") != LAYOUT_VERSION:
        logger.info("ignoring repacked-weight cache %s (not of layout version %d)", path, LAYOUT_VERSION)
        return None
    weights = {}
    try:
        for name, entry in header["weights"].items():
            tensors = {field: _view(mapping, data_start + spec["offset"], spec)
                       for field, spec in entry["tensors"].items()}
            weights[name] = QuantizedWeight(tensors["qs"], tensors["d"], tensors["m"], entry["bits"],
                                            entry["in_features"], entry["source_type"])
        _populate(mapping, _eager_ranges(header, data_start))
    except (KeyError, TypeError, ValueError, RuntimeError) as error:  # a damaged (e.g. truncated) file
        logger.warning("ignoring damaged repacked-weight cache %s (%s)", path, error)
        return None
    return weights


_MADV_POPULATE_READ = 22  # Linux 5.14+: map every page now, read-only (no copy), in one pass


def _eager_ranges(header: dict, data_start: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges, page-aligned and merged, of every weight but the experts of a
    mixture of experts: those are left to fault in when a token first picks them, so an expert
    no token picks is never paged in."""
    page = mmap.PAGESIZE
    ranges = []
    for name, entry in header["weights"].items():
        if ".experts." in name:
            continue
        for spec in entry["tensors"].values():
            start = data_start + spec["offset"]
            nbytes = _DTYPES[spec["dtype"]].itemsize * math.prod(spec["shape"])
            ranges.append((start // page * page, -(-(start + nbytes) // page) * page))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _populate(mapping: mmap.mmap, ranges: list[tuple[int, int]]) -> None:
    """Map those ranges' pages now rather than fault them in one at a time during the first steps
    (a 4 KiB fault each, about 0.4 s per 1.6 GB); where the kernel lacks that, ask for read-ahead."""
    for start, end in ranges:
        end = min(end, len(mapping))
        try:
            mapping.madvise(_MADV_POPULATE_READ, start, end - start)
        except (OSError, ValueError):
            if hasattr(mmap, "MADV_WILLNEED"):
                mapping.madvise(mmap.MADV_WILLNEED, start, end - start)


def _read_header(buffer) -> tuple[dict | None, int]:
    """(header, offset of the data) of a cache file's first bytes; (None, 0) if it is not one."""
    try:
        magic, (header_len,) = bytes(buffer[:8]), struct.unpack("<Q", buffer[8:16])
        header = json.loads(bytes(buffer[16:16 + header_len])) if magic == _MAGIC else None
    except (struct.error, ValueError):
        return None, 0
    return header, -(-(16 + header_len) // _ALIGN) * _ALIGN


def _evict_stale(directory: str) -> None:
    """Delete the cache files whose GGUF is gone or changed, or of another layout version."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not name.endswith(".kvq"):
            continue
        try:
            with open(path, "rb") as f:
                head = f.read(16)
                valid = len(head) == 16 and head[:8] == _MAGIC
                header_len = struct.unpack("<Q", head[8:16])[0] if valid else 0
                header, _ = _read_header(head + f.read(min(header_len, os.path.getsize(path))))
            source = (header or {}).get("source", {})
            stale = (header is None or header.get("layout_version") != LAYOUT_VERSION
                     or not os.path.isfile(source.get("path", ""))
                     or file_identity(source["path"])[1:] != (source.get("size"), source.get("mtime_ns")))
            if stale:
                os.remove(path)
        except OSError:
            continue


def _view(mapping: mmap.mmap, offset: int, spec: dict) -> torch.Tensor:
    dtype = _DTYPES[spec["dtype"]]
    count = 1
    for dim in spec["shape"]:
        count *= dim
    # The tensor keeps the mapping alive (torch holds the buffer's exporter).
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset).view(spec["shape"])
