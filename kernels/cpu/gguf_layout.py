"""The packed layouts of GGUF blocks: `records` rearranges a kind's fields into column blocks of
NB columns, the float form's (csrc/gguf_blocks.h describes it) or, for the kinds with high bits
and the K-quants, the integer form's (csrc/quant4.cpp: the same header, each group's integers in
quads of 4 k); `unpack` reads rows back from either form's (the embedding's lookups in a tied LM
head's packed copy)."""

from __future__ import annotations

import torch

from .gguf_blocks import BLOCK_K, HIGH_BITS, QK, Fields

__all__ = ["by_column", "records", "unpack"]


def by_column(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Per-row values `t` [N, ...] in the packed column order, zero in padding columns."""
    valid = order >= 0
    out = torch.zeros(order.numel(), *t.shape[1:], dtype=t.dtype)
    out[valid] = t[order[valid]]
    return out


def _head(f: Fields) -> list[torch.Tensor]:
    """The header's fields in record order, each [N, R, S]."""
    n, r = f.d.shape
    return [t.reshape(n, r, -1) for t in (f.d, f.m, f.sc, f.mn) if t is not None]


def _quads(qb: torch.Tensor, vw: int) -> torch.Tensor:
    """[..., QK k, NB] -> [..., quad, NV, 4 VW]: per quad of k and vector, byte 4 i + e is column
    i at k 4 quad + e (vpdpbusd's order)."""
    lead = qb.shape[:-2]
    quads = qb.reshape(*lead, QK // 4, 4, 4, vw)
    n = len(lead)
    return quads.permute(*range(n), n, n + 2, n + 3, n + 1).reshape(*lead, QK // 4, 4, 4 * vw)


def _planes(high: torch.Tensor, hb: int) -> torch.Tensor:
    """The integer form's high bits [..., quad, NV, 4 VW] (hb bits each) as planes of 4 VW
    bytes: slot s = (quad % Q) NV + vector (Q = 8 / (NV hb) quads a plane) at bits [s hb, s hb +
    hb) of each byte, so the kernel takes a vector's bits out of a whole plane with one shift
    and one mask (Q6_K: a plane a quad; Q5: a plane per two quads)."""
    *lead, quads, nv, vb = high.shape
    per = 8 // (nv * hb)  # quads a plane
    slots = high.reshape(*lead, quads // per, per * nv, vb)
    packed = slots[..., 0, :].clone()
    for s in range(1, per * nv):
        packed |= slots[..., s, :] << (s * hb)
    return packed


def records(f: Fields, order: torch.Tensor, nb: int, dot: bool = False) -> torch.Tensor:
    """uint8 [column blocks, K / BLOCK_K, record bytes]: the fields of the rows `order` names
    (linear.py's column order; -1: padding), NB columns a block; `dot`: the integer form's
    layout (not for Q4_0, Q4_1, Q8_0, whose integer form quant4 packs)."""
    n, k = f.q.shape
    r, gpr, blocks = k // BLOCK_K[f.kind], BLOCK_K[f.kind] // QK, order.numel() // nb
    head = []
    for t in _head(f):  # per field, [S][NB] values
        tb = by_column(t, order).view(blocks, nb, r, t.shape[-1]).permute(0, 2, 3, 1).contiguous()
        head.append(tb.view(torch.uint8).reshape(blocks, r, -1))
    qb = by_column(f.q, order).view(blocks, nb, r, gpr, QK).permute(0, 2, 3, 4, 1)  # [.., k, NB]
    if dot:  # per quad: NV / 2 chunks (vectors 2c, 2c + 1 as nibbles), then per vector the high bits
        quads = _quads(qb, nb // 4)  # [blocks, R, gpr, quad, NV, 4 VW]
        pairs = (quads & 15).reshape(*quads.shape[:-2], 2, 2, nb)
        parts = [(pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(blocks, r, gpr, -1)]
        hb = HIGH_BITS.get(f.kind, 0)
        if hb:  # planes of 4 VW bytes: byte p holds byte p's high bits of 8 / hb vectors (see _planes)
            parts.append(_planes(quads >> 4, hb).reshape(blocks, r, gpr, -1))
        groups = torch.cat(parts, dim=-1).reshape(blocks, r, -1)
    elif f.kind == "Q8_0":
        groups = qb.contiguous().view(torch.uint8).reshape(blocks, r, -1)
    else:  # chunk c of VW bytes: columns 2c*VW + i (low nibble) and (2c+1)*VW + i (high)
        pairs = (qb & 15).reshape(blocks, r, gpr, QK, 2, 2, nb // 4)
        parts = [(pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(blocks, r, gpr, -1)]
        hb = HIGH_BITS.get(f.kind, 0)
        if hb:  # column j at bits [j hb, j hb + hb) of each k's NB * hb bits
            per = 8 // hb
            high = (qb >> 4).reshape(blocks, r, gpr, QK, nb // per, per)
            packed = high[..., 0].clone()
            for t in range(1, per):
                packed |= high[..., t] << (t * hb)
            parts.append(packed.reshape(blocks, r, gpr, -1))
        groups = torch.cat(parts, dim=-1).reshape(blocks, r, -1)
    return torch.cat([*head, groups], dim=-1).contiguous()


def unpack(kind: str, data: torch.Tensor, nb: int, ids: torch.Tensor, like: Fields, dot: bool = False) -> Fields:
    """The fields of rows `ids` from records `data` (as `records` made them from fields shaped
    like `like`, whose tensors give the dtypes and sub-block counts): the float form's, or with
    `dot` the integer form's (any kind but Q8_0, whose integer form is offset binary)."""
    t, (blocks, r, _) = ids.numel(), data.shape
    block, lane = ids // nb, ids % nb
    recs = data[block]  # [T, R, record bytes]
    rows = torch.arange(t)
    off, head = 0, []
    for field in _head(like):
        s, size = field.shape[-1], field.element_size()
        part = recs[..., off:off + s * nb * size].reshape(t, r, s, nb, size)[rows, :, :, lane]  # [T, R, S, size]
        head.append(part.contiguous().view(field.dtype).reshape(t, r, s))
        off += s * nb * size
    gpr = BLOCK_K[kind] // QK
    groups = recs[..., off:].reshape(t, r, gpr, -1)
    if dot:
        q = _dot_quants(kind, groups, nb, lane)
    elif kind == "Q8_0":
        q = groups.reshape(t, r, gpr, QK, nb)[rows, :, :, :, lane].view(torch.int8)
    else:
        vw = nb // 4
        low = groups[..., :QK * nb // 2].reshape(t, r, gpr, QK, 2, vw)
        byte = low[rows, :, :, :, lane // (2 * vw), lane % vw]
        q = (byte >> (4 * (lane // vw % 2)).view(-1, 1, 1, 1).to(torch.uint8)) & 15
        hb = HIGH_BITS.get(kind, 0)
        if hb:
            high = groups[..., QK * nb // 2:].reshape(t, r, gpr, QK, nb * hb // 8)
            hbyte = high[rows, :, :, :, lane * hb // 8]
            q = q | (((hbyte >> (lane * hb % 8).view(-1, 1, 1, 1).to(torch.uint8)) & ((1 << hb) - 1)) << 4)
    q = q.reshape(t, -1)
    d, *rest = head
    names = [name for name, v in (("m", like.m), ("sc", like.sc), ("mn", like.mn)) if v is not None]
    return Fields(kind, q, d.reshape(t, r), **{name: (v.reshape(t, r) if name == "m" else v)
                                                for name, v in zip(names, rest)})


def _dot_quants(kind: str, groups: torch.Tensor, nb: int, lane: torch.Tensor) -> torch.Tensor:
    """The integer form's q of columns `lane` from their records' groups [T, R, gpr, bytes]:
    [T, R, gpr, quad, 4] (k = 4 quad + e). Column v VW + i is byte 4 i + e of vector v: in
    the nibbles of chunk v // 2 (low for even v), then in its high bits' planes (`_planes`)."""
    t, r, gpr, _ = groups.shape
    vw, rows = nb // 4, torch.arange(t)
    v, p = lane // vw, 4 * (lane % vw).view(t, 1) + torch.arange(4)  # p: [T, 4] bytes of the vector
    at = (t, r, gpr, QK // 4, 4)
    low = groups[..., :QK * nb // 2].reshape(t, r, gpr, QK // 4, 2, nb)[rows, :, :, :, v // 2]  # [T, R, gpr, quad, NB]
    byte = low.gather(-1, p.view(t, 1, 1, 1, 4).expand(at))
    q = (byte >> (4 * (v % 2)).view(t, 1, 1, 1, 1).to(torch.uint8)) & 15
    hb = HIGH_BITS.get(kind, 0)
    if hb:  # planes of NB bytes, `per` quads each (see _planes)
        per = 8 // (4 * hb)
        planes = groups[..., QK * nb // 2:].reshape(t, r, gpr, QK // 4 // per, nb).repeat_interleave(per, dim=3)
        hbyte = planes.gather(-1, p.view(t, 1, 1, 1, 4).expand(at))  # [T, R, gpr, quad, 4]
        slot = (torch.arange(QK // 4) % per).view(1, QK // 4) * 4 + v.view(t, 1)  # [T, quad]
        shift = (slot * hb).view(t, 1, 1, QK // 4, 1).to(torch.uint8)
        q = q | (((hbyte >> shift) & ((1 << hb) - 1)) << 4)
    return q
