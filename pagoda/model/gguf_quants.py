"""GGUF's block quantizations unpacked with torch ops: the legacy types (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0) and the K-quants (Q2_K to Q6_K), on whatever device the bytes are (a GPU's, or every CPU
core, where gguf-py's numpy reference runs on one: about 80 M weights a second for Q4_K, a minute
and a half for an 8B model).

Each type's layout is ggml's (ggml-common.h). A block unpacks to ``_Parts``: unsigned integers
``q`` and a scale a group of 16 or 32 of them, with either an integer zero point (the symmetric
types: ``value = scale (q - zero)``) or an offset a group (``value = scale q - offset``).
``dequantize`` computes the values from them in gguf-py's float32 operations and order, so they
equal its values bit for bit (the tests check it on random blocks); ``decompose`` gives the same
parts as ``(q - zero) * scale`` with a float zero a group of 16: the packed layout of
``pagoda.quant.int4``, in which ``quantization="gguf"`` keeps the weights."""
from __future__ import annotations

from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT


class _Parts(NamedTuple):
    q: torch.Tensor                     # (blocks, block size) uint8
    scale: torch.Tensor                 # (blocks, groups) float32
    zero: int = 0                       # value = scale (q - zero), or with
    offset: torch.Tensor | None = None  # (blocks, groups): value = scale q - offset


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


def _q8_0(x):      # d, 32 x int8 (stored here plus 128)
    return _Parts((x.view(torch.int8)[:, 2:].to(torch.int16) + 128).to(torch.uint8), _f16(x[:, :2]), 128)


def _q4_0(x):      # d, 16 bytes of nibbles: d (q - 8)
    return _Parts(_nibbles(x[:, 2:]), _f16(x[:, :2]), 8)


def _q4_1(x):      # d, m, 16 bytes of nibbles: d q + m
    return _Parts(_nibbles(x[:, 4:]), _f16(x[:, :2]), offset=-_f16(x[:, 2:4]))


def _q5(x, at):    # 4 bytes of fifth bits at ``at``, then 16 bytes of nibbles
    return _nibbles(x[:, at + 4:]) | (_bits(x[:, at:at + 4], 32) << 4)


def _q5_0(x):      # d, 32 high bits, 16 bytes of nibbles: d (q - 16)
    return _Parts(_q5(x, 2), _f16(x[:, :2]), 16)


def _q5_1(x):      # d, m, 32 high bits, 16 bytes of nibbles: d q + m
    return _Parts(_q5(x, 4), _f16(x[:, :2]), offset=-_f16(x[:, 2:4]))


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
    return _Parts(q, _f16(x[:, :2]) * scales, offset=_f16(x[:, 2:4]) * mins)


def _k_nibbles(qs):
    """128 bytes -> 256 values: each 32 bytes hold two sub-blocks, the low nibbles' then the high."""
    return _nibbles(qs.reshape(-1, 4, 32)).flatten(1)


def _q4_k(x):      # d, dmin, 12 bytes of scales, 128 bytes of nibbles
    return _k_quant(x, _k_nibbles(x[:, 16:]))


def _q5_k(x):      # and 32 bytes of fifth bits before the nibbles: sub-block j's from bit j of each byte
    high = ((x[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=x.device)[:, None]) & 1)
    return _k_quant(x, _k_nibbles(x[:, 48:]) | (high.flatten(1) << 4))


def _q6_k(x):
    """128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (one a 16 values), d: d scale
    (q - 32). Each half of 128 values: its 64 low-nibble bytes give values 0-63 (low nibbles) and
    64-127 (high); its 32 high-bit bytes give bits 4-5 of values l, l + 32, l + 64, l + 96 from
    bit pairs 0, 2, 4, 6."""
    low = _nibbles(x[:, :128].reshape(-1, 2, 64))                                # (blocks, 2, 128)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=x.device)[:, None]
    high = ((x[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).flatten(2)      # (blocks, 2, 128)
    return _Parts((low | (high << 4)).flatten(1), _f16(x[:, 208:210]) * x.view(torch.int8)[:, 192:208].float(), 32)


def _two_bit_planes(qs):
    """64 bytes -> 256 2-bit values (Q2_K / Q3_K): each half of 128 values from its 32 bytes,
    bit pairs 0, 2, 4, 6 giving values 0-31, 32-63, 64-95, 96-127 of it."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device)[:, None]
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).flatten(1)


def _q2_k(x):
    """16 bytes of scales (a 16 values: the scale's 4 bits low, the min's high), 64 bytes of 2-bit
    values, d, dmin: each group (d scale) q - (dmin min)."""
    scales = x[:, :16]
    return _Parts(_two_bit_planes(x[:, 16:80]), _f16(x[:, 80:82]) * (scales & 0x0F).float(),
                  offset=_f16(x[:, 82:84]) * (scales >> 4).float())


def _q3_k(x):
    """32 bytes of high bits, 64 bytes of 2-bit values, 12 bytes of 6-bit scales (a 16 values,
    stored plus 32), d: d scale (q - 4), value i's q the 2-bit value plus 4 times bit (i // 32) of
    byte i % 32. Scale s: the low 4 bits are nibble s // 8 of byte s % 8, the high 2 bits bits
    2 (s // 4) of byte 8 + s % 4."""
    b = x[:, 96:108]
    group = torch.arange(16, device=x.device)
    low = (b[:, group % 8] >> (4 * (group // 8)).to(torch.uint8)) & 0x0F
    high = (b[:, 8 + group % 4] >> (2 * (group // 4)).to(torch.uint8)) & 3
    scales = (low | (high << 4)).to(torch.int8) - 32
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)[:, None]
    bit = ((x[:, :32].unsqueeze(1) >> shifts) & 1).flatten(1)               # (blocks, 256)
    return _Parts(_two_bit_planes(x[:, 32:96]) | (bit << 2), _f16(x[:, 108:110]) * scales.float(), 4)


_PARTS = {QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1,
          QT.Q2_K: _q2_k, QT.Q3_K: _q3_k, QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k}
TYPES = frozenset(_PARTS)
GROUP = 16   # decompose's group: every type's groups are 16 or 32 values


def _parts(raw: torch.Tensor, qtype: QT) -> tuple[_Parts, int]:
    """The parts of a tensor's bytes (uint8, a whole number of blocks) and their group size."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    parts = _PARTS[qtype](raw.view(-1, type_size))
    return parts, block // parts.scale.shape[1]


def dequantize(raw: torch.Tensor, qtype: QT) -> torch.Tensor:
    """A tensor's bytes (uint8, a whole number of blocks) as float32, one row of ``block size``
    values a block: (blocks, block size). ``qtype`` must be in TYPES."""
    p, group = _parts(raw, qtype)
    q = p.q.view(p.q.shape[0], -1, group)
    if p.offset is None:
        values = p.scale.unsqueeze(-1) * (q.to(torch.int16) - p.zero).float()
    else:
        values = p.scale.unsqueeze(-1) * q.float() - p.offset.unsqueeze(-1)
    return values.flatten(1)


def decompose(raw: torch.Tensor, qtype: QT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tensor's bytes as ``(q, scale, zero)``: q uint8 ``(blocks, block size)``, scale and zero
    float32 ``(blocks, block size / GROUP)``, value i ``(q[i] - zero[g]) * scale[g]`` with ``g =
    i // GROUP`` (equal to ``dequantize``'s values up to float32 rounding). A group whose values
    are all one number but whose scale is 0 (scale q - offset with q's scale gone) becomes q = 0,
    zero = -1, scale = that number, which the form holds exactly."""
    p, group = _parts(raw, qtype)
    scale = p.scale
    if p.offset is None:
        zero = torch.full_like(scale, p.zero)
    else:
        flat = scale == 0
        zero = p.offset / torch.where(flat, 1.0, scale)
        if bool(flat.any()):
            zero = torch.where(flat, -1.0, zero)
            scale = torch.where(flat, -p.offset, scale)
            q = p.q.view(p.q.shape[0], -1, group)
            p = p._replace(q=torch.where(flat.unsqueeze(-1), 0, q).flatten(1).to(torch.uint8))
    repeat = group // GROUP
    return p.q, scale.repeat_interleave(repeat, 1), zero.repeat_interleave(repeat, 1)
