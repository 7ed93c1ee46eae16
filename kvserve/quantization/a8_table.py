"""Table codes: 8-bit codes that take at most 16 distinct values (MXFP4, GGUF IQ4_NL) stored
as 4-bit indices into a table, for both CPU kernels.

Which weights: MXFP4 (gpt-oss's experts: twice the E2M1 values, 15 of them in [-12, 12]) and
GGUF's IQ4_NL and IQ4_XS (16 non-linear levels in [-127, 113]; table codes take per-group
records, so IQ4_XS's two levels of scales become a float32 scale per 32: 5 bits a weight
against its super records' 8.3). As plain 8-bit codes they stream 8 bits a weight, as 5-bit
planes (MXFP4's range) 5; indexed, 4, the same as the file's.

* The int8-activation kernel (``csrc/quant_linear_a8.cpp``, AVX512-VNNI) maps each nibble
  through the table with one vpermb per 64 codes (vpshufb and a mask without AVX512-VBMI) and
  multiplies the bytes it gets, so the sums, and the outputs, are those of the 8-bit codes bit
  for bit; tiles of 8 rows pay each lookup once for 8 rows (faster than the bytes at every row
  count measured, 1-128: ``csrc/quant_linear_a8.cpp``'s ``a8_tile``). Layout: ``pack_a8``'s
  int4 records of the indices, then a trailer of ``TABLE_BYTES`` whose first 16 bytes are the
  table of ``u = value + offset`` (unsigned, as vpdpbusd takes the weights); the op learns of
  it from ``A8_TABLE`` in its ``scale_format``.
* The weight-only kernel (``csrc/quant_linear.cpp``: float32 activations on every CPU, the
  AVX2 machines' path, and bf16 with ``--quantization-activations none``) looks the nibbles up
  with pshufb (AVX2) or vpermd (AVX-512) and widens the values as it widens byte codes, so its
  outputs are the byte codes' bit for bit too. Layout: ``pack_codes``' int4 layout of the
  indices, then ``TABLE_BYTES`` whose first 16 are the values themselves (``signed_trailer``);
  the op learns of it from its offset ``TABLE_OFFSET``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.quantization.qweight import QuantizedWeight

A8_TABLE = 4  # the op's scale_format bit: codes are indices into the trailer's table
TABLE_BYTES = 64  # the trailer (16 bytes used; a cache line keeps the records aligned)
TABLE_OFFSET = -1  # quant_linear's offset for table codes (csrc/quant_linear.cpp, kTableOffset)
TABLE_SIZE = 16


@dataclass(frozen=True)
class A8Table:
    """Up to 16 code values (ascending, int8) and the offset making them unsigned bytes."""

    values: torch.Tensor  # [V <= 16] int8, ascending

    @property
    def offset(self) -> int:
        """``o``: ``u = c + o`` in [0, 255] for every value (0 if none is negative)."""
        return max(0, -int(self.values[0]))

    def indices(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [N, K]`` int8 as their places in the table ``[N, K]`` int8 in [0, V): one
        byte lookup per code by numpy (the codes' bytes index it directly; torch's gather
        wants an int64 index per code: 18x slower on a gpt-oss expert's 16.6M codes, 22
        against 399 ms, and 8 bytes a weight of temporaries)."""
        place = np.zeros(256, dtype=np.int8)  # by the code's byte
        place[self.values.view(torch.uint8).numpy()] = np.arange(len(self.values))
        flat = codes.reshape(-1).view(torch.uint8).numpy()  # [N * K], the codes' memory
        return torch.from_numpy(place[flat]).reshape(codes.shape)

    def trailer(self) -> torch.Tensor:
        """``[TABLE_BYTES]`` uint8: the table of u (unused entries repeat the last)."""
        u = self.values.to(torch.int16) + self.offset  # [V] in [0, 255]
        table = torch.cat([u, u[-1:].expand(TABLE_SIZE - len(u))]).to(torch.uint8)
        return torch.cat([table, torch.zeros(TABLE_BYTES - TABLE_SIZE, dtype=torch.uint8)])

    def signed_trailer(self) -> torch.Tensor:
        """``[TABLE_BYTES]`` uint8: the values' own bytes (int8; unused entries repeat the
        last), quant_linear's table."""
        table = torch.cat([self.values, self.values[-1:].expand(TABLE_SIZE - len(self.values))])
        pad = torch.zeros(TABLE_BYTES - TABLE_SIZE, dtype=torch.uint8)
        return torch.cat([table.view(torch.uint8), pad])


def a8_table(qw: QuantizedWeight) -> A8Table | None:
    """The table of ``qw``'s 8-bit codes if they take at most 16 values, else None (codes
    already 4-bit gain nothing from one). Counted on the codes' bytes (no wider copy: 8 ms
    for a gpt-oss expert's 16.6M codes)."""
    if qw.bits != 8 or qw.codes.dtype != torch.int8 or qw.codes.numel() == 0:
        return None
    counts = torch.bincount(qw.codes.reshape(-1).view(torch.uint8), minlength=256)  # by byte
    present = torch.nonzero(counts).reshape(-1)  # bytes, ascending
    if len(present) > TABLE_SIZE:
        return None
    values = torch.where(present >= 128, present - 256, present)  # as int8
    return A8Table(values.sort().values.to(torch.int8))
