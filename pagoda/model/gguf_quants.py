"""GGUF's block quantizations dequantized with torch ops: the legacy types (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0) and the K-quants (Q2_K to Q6_K: the Q2_K ... Q6_K files' types). gguf-py's numpy reference runs on one core, about 80 M weights a second for Q4_K: a
minute and a half for an 8B model; torch's elementwise ops use every core. Each type's layout is
ggml's (ggml-common.h); the values equal gguf-py's bit for bit (same float32 operations in the same
order), which the tests check on random blocks. Other types (the IQ and ternary ones) are left
to gguf-py, or refused by the reader."""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(blocks, 2) bytes of a little-endian float16 -> (blocks, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(blocks, n) bytes -> (blocks, 2n): the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """(blocks, count // 8) bytes -> (blocks, count) 0/1, bit i of the little-endian bit string at i."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], count)


def _q8_0(x):      # d, 32 x int8
    return _f16(x[:, :2]) * x.view(torch.int8)[:, 2:].float()


def _q4_0(x):      # d, 16 bytes of nibbles: q - 8
    return _f16(x[:, :2]) * (_nibbles(x[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(x):      # d, m, 16 bytes of nibbles: d q + m
    return _f16(x[:, :2]) * _nibbles(x[:, 4:]).float() + _f16(x[:, 2:4])


def _q5(x, offset):   # 4 bytes of fifth bits at offset, then 16 bytes of nibbles
    return _nibbles(x[:, offset + 4:]) | (_bits(x[:, offset:offset + 4], 32) << 4)


def _q5_0(x):      # d, 32 high bits, 16 bytes of nibbles: q - 16
    return _f16(x[:, :2]) * (_q5(x, 2).to(torch.int8) - 16).float()


def _q5_1(x):      # d, m, 32 high bits, 16 bytes of nibbles: d q + m
    return _f16(x[:, :2]) * _q5(x, 4).float() + _f16(x[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins: bytes 0-3 hold the first
    four scales (low 6 bits), 4-7 the first four mins; bytes 8-11 the last four's low 4 bits
    (scales low nibble, mins high), their high 2 bits the top bits of bytes 0-3 / 4-7."""
    first, second, last = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([first & 0x3F, (last & 0x0F) | ((first >> 6) << 4)], dim=-1)
    mins = torch.cat([second & 0x3F, (last >> 4) | ((second >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k_quant(x, q):
    """Q4_K / Q5_K: each sub-block of 32 is (d scale) q - (dmin min); q is (blocks, 256), in
    sub-block order."""
    scales, mins = _k_scales(x[:, 4:16])
    d, dmin = _f16(x[:, :2]) * scales, _f16(x[:, 2:4]) * mins
    return (d.unsqueeze(-1) * q.float().view(-1, 8, 32) - dmin.unsqueeze(-1)).flatten(1)


def _k_nibbles(qs):
    """128 bytes -> 256 values: each 32 bytes hold two sub-blocks, the low nibbles' then the high."""
    return _nibbles(qs.reshape(-1, 4, 32)).flatten(1)


def _q4_k(x):      # d, dmin, 12 bytes of scales, 128 bytes of nibbles
    return _k_quant(x, _k_nibbles(x[:, 16:]))


def _q5_k(x):      # and 32 bytes of fifth bits before the nibbles: sub-block j's from bit j of each byte
    high = ((x[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=x.device)[:, None]) & 1)
    return _k_quant(x, _k_nibbles(x[:, 48:]) | (high.flatten(1) << 4))


def _q6_k(x):
    """128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (one a 16 values), d. Each half
    of 128 values: its 64 low-nibble bytes give values 0-63 (low nibbles) and 64-127 (high); its
    32 high-bit bytes give bits 4-5 of values l, l + 32, l + 64, l + 96 from bit pairs 0, 2, 4, 6."""
    low = _nibbles(x[:, :128].reshape(-1, 2, 64))                                # (blocks, 2, 128)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=x.device)[:, None]
    high = ((x[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).flatten(2)      # (blocks, 2, 128)
    q = ((low | (high << 4)).to(torch.int8) - 32).float().view(-1, 16, 16)
    d = _f16(x[:, 208:210]) * x.view(torch.int8)[:, 192:208].float()
    return (d.unsqueeze(-1) * q).flatten(1)


def _two_bit_planes(qs):
    """64 bytes -> 256 2-bit values (Q2_K / Q3_K): each half of 128 values from its 32 bytes,
    bit pairs 0, 2, 4, 6 giving values 0-31, 32-63, 64-95, 96-127 of it."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device)[:, None]
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).flatten(1)


def _q2_k(x):
    """16 bytes of scales (a 16 values: the scale's 4 bits low, the min's high), 64 bytes of 2-bit
    values, d, dmin: each group (d scale) q - (dmin min)."""
    scales = x[:, :16]
    d = _f16(x[:, 80:82]) * (scales & 0x0F).float()
    dmin = _f16(x[:, 82:84]) * (scales >> 4).float()
    q = _two_bit_planes(x[:, 16:80]).float().view(-1, 16, 16)
    return (d.unsqueeze(-1) * q - dmin.unsqueeze(-1)).flatten(1)


def _q3_k(x):
    """32 bytes of high bits, 64 bytes of 2-bit values, 12 bytes of 6-bit scales (a 16 values,
    stored plus 32), d. Value i's high bit is bit (i // 32) of byte i % 32; where it is clear the
    value is 4 less. Scale s: the low 4 bits are nibble s // 8 of byte s % 8, the high 2 bits bits
    2 (s // 4) of byte 8 + s % 4."""
    b = x[:, 96:108]
    group = torch.arange(16, device=x.device)
    low = (b[:, group % 8] >> (4 * (group // 8)).to(torch.uint8)) & 0x0F
    high = (b[:, 8 + group % 4] >> (2 * (group // 4)).to(torch.uint8)) & 3
    scales = (low | (high << 4)).to(torch.int8) - 32
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)[:, None]
    bit = ((x[:, :32].unsqueeze(1) >> shifts) & 1).flatten(1)               # (blocks, 256)
    q = (_two_bit_planes(x[:, 32:96]).to(torch.int8) - 4 * (1 - bit.to(torch.int8))).float()
    d = _f16(x[:, 108:110]) * scales.float()
    return (d.unsqueeze(-1) * q.view(-1, 16, 16)).flatten(1)


_DEQUANTIZE = {QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1,
               QT.Q2_K: _q2_k, QT.Q3_K: _q3_k, QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k}
TYPES = frozenset(_DEQUANTIZE)


def dequantize(raw: torch.Tensor, qtype: QT) -> torch.Tensor:
    """A tensor's bytes (uint8, a whole number of blocks) as float32, one row of ``block size``
    values a block: (blocks, block size). ``qtype`` must be in TYPES."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    out = _DEQUANTIZE[qtype](raw.view(-1, type_size))
    assert out.shape[1] == block
    return out
