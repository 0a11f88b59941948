"""What a test asks of a GGUF file we wrote: its fields and each tensor's type, read from the header. gguf's own
GGUFReader parses every element of every array before it answers (18 s for Gemma 3's 262k-token vocabulary here, once
per test); this reads past the arrays and takes the value and tensor types from gguf itself."""

from __future__ import annotations

import mmap
import struct

import gguf

V = gguf.GGUFValueType
SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i", V.FLOAT32: "<f", V.BOOL: "<?",
           V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
SHORT = 64  # arrays of per-layer values and sections are read; vocabularies are not


class _Header:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos]).decode()

    def value(self, kind: V):
        """A scalar or a string; an array of at most SHORT numbers as a list of them; a longer one, or one of strings,
        read past and standing for its length."""
        if kind == V.STRING:
            return self.string()
        if kind != V.ARRAY:
            return self.take(SCALARS[kind])
        inner, n = V(self.take("<I")), self.take("<Q")
        if inner in SCALARS and n <= SHORT:
            return [self.take(SCALARS[inner]) for _ in range(n)]
        if inner in SCALARS:
            self.pos += n * struct.calcsize(SCALARS[inner])
        elif inner == V.STRING:  # not decoded: a vocabulary's byte tokens are no UTF-8 of their own
            for _ in range(n):
                length = self.take("<Q")  # taken first: `pos += take()` would add to the position before the take
                self.pos += length
        else:
            for _ in range(n):
                self.value(inner)
        return n


def read_header(path) -> tuple[dict, dict]:
    """({field: value}, {tensor name: its GGML type's name, e.g. "Q4_K"})."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = _Header(data)
        assert header.take("<I") == gguf.GGUF_MAGIC, f"{path}: not a GGUF file"
        header.take("<I")  # the format's version
        n_tensors, n_fields = header.take("<Q"), header.take("<Q")
        fields = {header.string(): header.value(V(header.take("<I"))) for _ in range(n_fields)}
        tensors = {}
        for _ in range(n_tensors):
            name = header.string()
            dims = header.take("<I")
            header.pos += 8 * dims
            tensors[name] = gguf.GGMLQuantizationType(header.take("<I")).name
            header.take("<Q")  # its offset in the data
        return fields, tensors
