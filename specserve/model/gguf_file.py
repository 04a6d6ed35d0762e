"""A GGUF file's metadata and tensors, read from one memory map: `GGUFFile`.

gguf-py's GGUFReader makes a numpy view per element of every array it parses; Qwen2.5's
151,936 tokens and as many merges cost it 10+ seconds before the first weight is read.
Here strings are decoded from the mapped bytes in one Python loop and numeric arrays
are one `np.frombuffer` each, so the whole header takes a fraction of a second.

The format (versions 2 and 3, little-endian): the magic b"GGUF", a u32 version, u64
tensor and key/value counts, the key/values (a string key, a u32 value type, the value),
the tensor infos (a string name, a u32 dimension count, u64 dimensions fastest-varying
first, a u32 ggml type, a u64 offset into the data section), padding up to
`general.alignment` (default 32), then the data section. A string is a u64 byte length
and UTF-8 bytes; an array is a u32 item type, a u64 count and the items.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from specserve.errors import ModelFormatError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, key/value count

# Little-endian numpy dtypes of the fixed-size value types; a scalar is an array of one.
_VALUE_DTYPES = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}

# Tensor types stored as plain numbers, viewed with their own dtype in the logical shape;
# every other type is blocks of bytes, viewed as uint8 rows (as gguf-py does).
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclass(frozen=True, eq=False)  # eq would compare the arrays, which has no single truth value
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: the row length (ggml's ne[0]) first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # a read-only view of the mapped file; see _ELEMENT_DTYPES for its dtype


class GGUFFile:
    """The parsed header of a GGUF file. `metadata` holds every key/value in file order
    (strings as str, numbers as int/float/bool, arrays as lists); `tensors` every tensor
    in file order, its data still on disk until read."""

    def __init__(self, path: str):
        self.path = path
        self._buffer = _map(path)
        cursor = _Cursor(self._buffer, path)
        try:
            self.version, tensor_count, key_count = _read_header(cursor)
            self.metadata = _unique(path, "key", (_read_key_value(cursor) for _ in range(key_count)))
            infos = [_read_tensor_info(cursor) for _ in range(tensor_count)]
            data_start = _aligned(cursor.offset, self._alignment())
            self.tensors = _unique(path, "tensor", ((info[0], self._tensor(data_start, *info)) for info in infos))
        except struct.error as error:  # a read past the end: the file is cut short or a length in it is wrong
            raise ModelFormatError(f"{path} is not a readable GGUF file (truncated or damaged: {error})") from None
        except UnicodeDecodeError as error:
            raise ModelFormatError(f"{path} is not a readable GGUF file (a string is not UTF-8: {error})") from None

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFormatError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        return alignment

    def _tensor(self, data_start: int, name: str, shape: tuple[int, ...], type_code: int, offset: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(type_code)
        except ValueError:
            raise ModelFormatError(f"{self.path}: tensor {name} has unknown ggml type {type_code}") from None
        dtype, array_shape = _array_layout(self.path, name, shape, tensor_type)
        start = data_start + offset
        size = dtype.itemsize * math.prod(array_shape)  # Python ints: garbage dimensions cannot overflow
        end, file_size = start + size, len(self._buffer)
        if end > file_size:
            raise ModelFormatError(f"{self.path} is truncated: tensor {name} ends at byte {end} of {file_size}")
        data = np.frombuffer(self._buffer, dtype, size // dtype.itemsize, start).reshape(array_shape)
        return GGUFTensor(name, shape, tensor_type, data)


class _Cursor:
    """Reads values one after another from the mapped bytes. A read past the end (the file
    is cut short, or a length in it is wrong) raises struct.error or ModelFormatError."""

    def __init__(self, buffer: mmap.mmap, path: str):
        self.buffer, self.path, self.offset = buffer, path, 0

    def unpack(self, layout: struct.Struct) -> tuple:
        values = layout.unpack_from(self.buffer, self.offset)
        self.offset += layout.size
        return values

    def u32(self) -> int:
        return self.unpack(_U32)[0]

    def u64(self) -> int:
        return self.unpack(_U64)[0]

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        # the hot loop of a vocabulary: locals only, the end checked once after it
        buffer, offset, unpack_length = self.buffer, self.offset, _U64.unpack_from
        texts = []
        for _ in range(count):
            (length,) = unpack_length(buffer, offset)
            offset += 8 + length
            texts.append(str(buffer[offset - length:offset], "utf-8"))
        self._move_to(offset)
        return texts

    def value(self, value_type: int) -> Any:
        if value_type == GGUFValueType.ARRAY:
            return self.array()
        return self.items(value_type, 1)[0]

    def array(self) -> list:
        item_type, count = self.u32(), self.u64()
        if item_type == GGUFValueType.ARRAY:  # gguf-py flattens nested arrays; we keep their structure
            return [self.array() for _ in range(count)]
        return self.items(item_type, count)

    def items(self, value_type: int, count: int) -> list:
        if value_type == GGUFValueType.STRING:
            return self.strings(count)
        dtype = _VALUE_DTYPES.get(value_type)
        if dtype is None:
            raise ModelFormatError(f"{self.path}: unknown GGUF value type {value_type} at byte {self.offset}")
        start = self.offset
        self._move_to(start + dtype.itemsize * count)
        return np.frombuffer(self.buffer, dtype, count, start).tolist()

    def _move_to(self, offset: int) -> None:
        if offset > len(self.buffer):
            raise ModelFormatError(
                f"{self.path} is truncated: its metadata runs to byte {offset}, the file has {len(self.buffer)}")
        self.offset = offset


def _map(path: str) -> mmap.mmap:
    with open(path, "rb") as file:
        try:
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ModelFormatError(f"{path} is not a GGUF file (it is empty)") from None


def _read_header(cursor: _Cursor) -> tuple[int, int, int]:
    if cursor.buffer[:4] != _MAGIC:
        raise ModelFormatError(f"{cursor.path} is not a GGUF file (it does not start with the GGUF magic)")
    _, version, tensor_count, key_count = cursor.unpack(_HEADER)
    if version not in _VERSIONS:
        # a big-endian file reads as a version with its low 16 bits zero
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ModelFormatError(f"{cursor.path} is GGUF version {version}{endian}; only versions 2 and 3 are readable")
    return version, tensor_count, key_count


def _read_key_value(cursor: _Cursor) -> tuple[str, Any]:
    key = cursor.string()
    return key, cursor.value(cursor.u32())


def _read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """(name, shape in GGUF order, ggml type code, offset into the data section)"""
    name = cursor.string()
    shape = tuple(cursor.items(GGUFValueType.UINT64, cursor.u32()))
    return name, shape, cursor.u32(), cursor.u64()


def _array_layout(path: str, name: str, shape: tuple[int, ...],
                  tensor_type: GGMLQuantizationType) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape of the tensor's data view: the logical (row-major, slowest
    dimension first) shape for plain numbers; for blocks, uint8 with the last dimension
    counted in bytes."""
    logical = tuple(reversed(shape))
    if tensor_type in _ELEMENT_DTYPES:
        return _ELEMENT_DTYPES[tensor_type], logical
    block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if not logical or logical[-1] % block_size:
        raise ModelFormatError(
            f"{path}: tensor {name} has rows of {logical[-1] if logical else 0} values, "
            f"not a multiple of {tensor_type.name}'s block of {block_size}")
    return np.dtype(np.uint8), (*logical[:-1], logical[-1] // block_size * block_bytes)


def _aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _unique(path: str, what: str, pairs) -> dict[str, Any]:
    """A dict of the (name, value) pairs, refusing a name given twice (which would be ambiguous)."""
    result: dict[str, Any] = {}
    for name, value in pairs:
        if name in result:
            raise ModelFormatError(f"{path} has the {what} {name!r} twice")
        result[name] = value
    return result
