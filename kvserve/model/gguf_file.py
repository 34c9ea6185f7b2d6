"""A lazy reader of GGUF files: metadata and tensor locations, nothing more.

`gguf.GGUFReader` builds a numpy view for every part of every metadata
entry at open time; a Llama-style vocabulary makes that ~150k entries and
several seconds. This reader walks the header once with `struct`, decodes
scalars and strings, records arrays by offset only (string arrays are
skipped over by their length prefixes) and maps the tensor data as plain
ndarray views of one private (copy-on-write) mmap: the loader holds weights
whose layout is the file's as views of it (kvserve/model/stored_weight.py),
so their pages are the page cache's, shared by every process that maps the
file. Little-endian GGUF v2/v3 only.
"""
from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType) -> struct format.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass
class GGUFField:
    """One metadata entry. Arrays are decoded only when `contents()` is called."""

    name: str
    value_type: int
    value: Any = None  # scalars and strings
    element_type: int | None = None  # arrays
    count: int = 0  # arrays: number of elements
    offset: int = 0  # arrays: file offset of the first element
    _buffer: Any = None

    def contents(self) -> Any:
        """The value as Python objects (list for arrays), like gguf's ReaderField.contents()."""
        if self.value_type != _ARRAY:
            return self.value
        if self.element_type == _STRING:
            strings, offset = [], self.offset
            for _ in range(self.count):
                (length,) = struct.unpack_from("<Q", self._buffer, offset)
                strings.append(bytes(self._buffer[offset + 8:offset + 8 + length]).decode("utf-8"))
                offset += 8 + length
            return strings
        if self.element_type == _ARRAY:
            raise GGUFFormatError(f"{self.name}: nested arrays are not supported")
        return np.frombuffer(self._buffer, dtype=_NUMPY_TYPES[self.element_type], count=self.count,
                             offset=self.offset).tolist()


@dataclass
class GGUFTensor:
    """A tensor's name, GGML type, dims (GGUF order: fastest first) and raw data view.

    `data` is shaped like gguf's ReaderTensor.data: the PyTorch shape for plain
    types, and (rows..., bytes per row) as uint8 for block-quantized ones.
    """

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """Metadata (`fields`) and tensors (`tensors`) of one GGUF file, memory-mapped copy-on-write
    (nothing writes to it: writable views only spare torch's warning about read-only buffers)."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._buffer = memoryview(self._mmap)
        self.path = path
        if bytes(self._buffer[:4]) != GGUF_MAGIC:
            raise GGUFFormatError("GGUF magic not found")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._buffer, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
        self._offset = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            field = self._read_field()
            self.fields[field.name] = field
        infos = [self._read_tensor_info() for _ in range(tensor_count)]
        alignment = self.get("general.alignment", _DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"invalid general.alignment {alignment}")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(name, dims, raw_type, data_start + offset)
                        for name, dims, raw_type, offset in infos]

    def populate(self, spans: list[tuple[int, int]], huge_runs: list[tuple[int, int]] = ()) -> None:
        """Map the pages of the (address, length) spans of this file's mapping now (see
        `populate`); spans outside it are ignored. The aligned 2 MiB windows inside the
        (address, length) `huge_runs` are first advised huge folios and read in."""
        for start, length in self._huge_windows(huge_runs):  # before the spans, whose read-ahead
            advise_huge_folios(self._mmap, start, length)  # would fill them with small folios
            populate(self._mmap, start, length)
        base = self._base()
        for address, length in spans:
            start = (address - base) // mmap.PAGESIZE * mmap.PAGESIZE
            if 0 <= start < len(self._mmap):
                populate(self._mmap, start, min(address - base + length, len(self._mmap)) - start)

    def advise_huge(self, runs: list[tuple[int, int]]) -> None:
        """Advise huge folios (`advise_huge_folios`) for the aligned 2 MiB windows inside the
        (address, length) `runs`, read in whole when first touched."""
        for start, length in self._huge_windows(runs):
            advise_huge_folios(self._mmap, start, length)

    def _base(self) -> int:
        return np.frombuffer(self._buffer, dtype=np.uint8, count=1).ctypes.data

    def _huge_windows(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(offset, length) in the mapping of the 2 MiB-aligned windows inside each (address, length) run."""
        base, windows = self._base(), []
        for address, length in runs:
            start = -(-(address - base) // HUGE_FOLIO_BYTES) * HUGE_FOLIO_BYTES
            end = min(address - base + length, len(self._mmap)) // HUGE_FOLIO_BYTES * HUGE_FOLIO_BYTES
            if 0 <= start < end:
                windows.append((start, end - start))
        return windows

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    # -- parsing -----------------------------------------------------------------------

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _read_string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self._buffer[self._offset:self._offset + length]).decode("utf-8")
        self._offset += length
        return text

    def _read_field(self) -> GGUFField:
        name = self._read_string()
        (value_type,) = self._unpack("<I")
        if value_type == _STRING:
            return GGUFField(name, value_type, value=self._read_string())
        if value_type in _SCALAR_FORMATS:
            return GGUFField(name, value_type, value=self._unpack(_SCALAR_FORMATS[value_type])[0])
        if value_type != _ARRAY:
            raise GGUFFormatError(f"{name}: unknown metadata type {value_type}")
        element_type, count = self._unpack("<IQ")
        field = GGUFField(name, value_type, element_type=element_type, count=count, offset=self._offset,
                          _buffer=self._buffer)
        self._skip_array(name, element_type, count)
        return field

    def _skip_array(self, name: str, element_type: int, count: int) -> None:
        if element_type in _SCALAR_FORMATS:
            self._offset += count * struct.calcsize(_SCALAR_FORMATS[element_type])
        elif element_type == _STRING:
            buffer, offset, unpack = self._buffer, self._offset, struct.Struct("<Q").unpack_from
            for _ in range(count):
                offset += 8 + unpack(buffer, offset)[0]
            self._offset = offset
        else:
            raise GGUFFormatError(f"{name}: arrays of type {element_type} are not supported")

    def _read_tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._read_string()
        (num_dims,) = self._unpack("<I")
        dims = self._unpack(f"<{num_dims}Q")
        raw_type, offset = self._unpack("<IQ")
        return name, tuple(int(d) for d in dims), raw_type, offset

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, start: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensor_type = GGMLQuantizationType(raw_type)
        numpy_shape = tuple(reversed(dims))
        num_elements = int(np.prod(dims, dtype=np.int64))
        plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}.get(tensor_type)
        if plain is not None:
            data = np.frombuffer(self._buffer, dtype=plain, count=num_elements, offset=start)
            return GGUFTensor(name, tensor_type, dims, data.reshape(numpy_shape))
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if numpy_shape[-1] % block_size:
            raise GGUFFormatError(f"{name}: row of {numpy_shape[-1]} is not a multiple of {block_size}")
        byte_shape = (*numpy_shape[:-1], numpy_shape[-1] // block_size * type_size)
        data = np.frombuffer(self._buffer, dtype=np.uint8, count=num_elements // block_size * type_size,
                             offset=start)
        return GGUFTensor(name, tensor_type, dims, data.reshape(byte_shape))


_MADV_POPULATE_READ = 22  # Linux 5.14+: map every page now, read-only (no copy), in one pass


def populate(mapping: mmap.mmap, start: int = 0, length: int | None = None) -> None:
    """Map a file mapping's pages (all, or `length` bytes from the page-aligned `start`) now
    rather than fault them in one at a time during the first steps (a 4 KiB fault each, about
    0.4 s per 1.6 GB); where the kernel lacks that, ask for read-ahead."""
    length = len(mapping) - start if length is None else length
    try:
        mapping.madvise(_MADV_POPULATE_READ, start, length)
    except (OSError, ValueError):
        if hasattr(mmap, "MADV_WILLNEED"):
            mapping.madvise(mmap.MADV_WILLNEED, start, length)


HUGE_FOLIO_BYTES = 2 << 20  # a PMD: one TLB entry maps a 2 MiB folio mapped at a 2 MiB-aligned address


def advise_huge_folios(mapping: mmap.mmap, start: int, length: int) -> None:
    """Ask that the pages of [start, start + length) of a file mapping (2 MiB-aligned offsets) that
    are not cached yet be read in as 2 MiB folios, each exactly its aligned window (no read-ahead
    past it: MADV_RANDOM), which Linux maps with one TLB entry each. A Q4_K_M MoE decode step reads
    its weights spread over GBs: on 4 KiB folios each page costs a TLB miss and a page walk, and
    the same steps ran ~15% slower (one thread, Zen 5) than on 2 MiB ones. Pages already cached
    keep their folios. Where the OS lacks the advice the mapping stays as it is."""
    for advice in ("MADV_RANDOM", "MADV_HUGEPAGE"):
        try:
            mapping.madvise(getattr(mmap, advice), start, length)
        except (AttributeError, OSError, ValueError):
            pass


def file_identity(path: str) -> tuple[str, int, int]:
    """(absolute path, size, mtime in ns): what on-disk caches of a file are keyed by."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    return path, stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensor views (memory-mapped, cached per path, size and mtime)."""
    return _open_reader(*file_identity(path))


def release_gguf_mappings() -> None:
    """Forget the open readers, so that the mappings of files whose weights are loaded (and whose
    pages would otherwise stay resident in this process) go once nothing else holds them."""
    _open_reader.cache_clear()
