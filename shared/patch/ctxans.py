"""Encoding `ctxans`: bf16 changes coded with rANS under contexts taken from the base weights
(normative spec: docs/patch-format.md §4.1).

Why: a bf16 weight changes when its fp32 master crosses half a bf16 ulp, and the ulp is set by the
weight's exponent, so the chance that an element changes depends strongly on its base exponent
(small weights change far more often under Adam). Coding positions and values conditioned on the
base exponent, per tensor, goes below the i.i.d. floor H(p)/p + 1 bits per changed weight
(PULSE, arXiv 2602.03839, and every sparse codec before it code positions as if i.i.d.).

Model: element i's class is its base exponent field `(b_i >> 7) & 0xFF`. In class-major order
(classes ascending, flat index ascending within a class) the changed elements' ranks within their
class are gap-coded. Gap tables are geometric, derived in integers from each class's change count
and size (nothing stored: a stored table per class cost ~0.3 bit per change on the small shape);
value tables are stored, one per class where that pays, else pooled per tensor. Coder:
32-bit rANS with 16-bit renormalisation (Duda, arXiv 1311.2540; the word variant of F. Giesen's
public-domain ryg_rans), `LANE_STEPS`-symbol lanes that code independently, so every lane of every
tensor of a patch advances together (one vectorised torch step on CPU threads; on a GPU one Triton
kernel runs each lane's steps). Everything around the coder also runs on all entries at once
(same-size bases share one class sort), so a model's ~200 tensors cost a fixed number of passes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import CorruptPatchError, TensorMismatchError
from .fused import triton  # None without Triton (CPU-only installs): ans_decode keeps its torch loop

PREC = 12  # probability precision: every table's frequencies sum to 2**PREC
TOTAL = 1 << PREC
STATE_LOW = 1 << 16  # rANS state lives in [2**16, 2**32); the encoder starts (and the decoder ends) at 2**16
LANE_STEPS = 1024  # symbols per lane: a stream of n symbols has ceil(n / LANE_STEPS) lanes
GAP_ALPHABET = 96  # 0..15 literal gaps, then (bit length 5..44) x (next bit): 16 + 2 * 40
VALUE_ALPHABET = 40  # zigzag delta z in 1..2**16 - 1 as the gap symbol of z - 1 (bit length <= 16)
MAX_NUMEL = 1 << 31  # larger tensors use the other encodings (keeps every rank sum below 2**63)
_LITERAL_GAPS = 16
_U32 = struct.Struct("<I")


def supports(dtype: str, numel: int) -> bool:
    """Whether a tensor may be coded `ctxans`: bf16 only (the exponent field is bf16's)."""
    return dtype == "bfloat16" and 0 < numel < MAX_NUMEL


def classes(base_bits: torch.Tensor) -> torch.Tensor:
    """Each element's context: the exponent field of its base bf16 bit pattern (int16 view)."""
    return ((base_bits >> 7) & 0xFF).to(torch.uint8)


# Tensors of one size have their classes sorted together, at most this many elements at once
# (a sort's temporaries are ~20 bytes an element); one larger tensor is sorted on its own.
_SORT_ELEMENTS = 1 << 28


@dataclass
class _SortGroup:
    """Entries of one size whose classes were sorted together, one row each."""

    members: list[int]  # entry positions, in row order
    numel: int
    perm: torch.Tensor  # int64 (rows, numel): class-major position -> flat index, per row
    hist: torch.Tensor  # int64 (rows, 256): elements per class, per row


def _size_groups(bases: list[torch.Tensor]) -> list[list[int]]:
    """Positions of `bases` grouped by size, each group at most _SORT_ELEMENTS elements in all
    (one larger tensor alone)."""
    by_numel: dict[int, list[int]] = {}
    for i, b in enumerate(bases):
        by_numel.setdefault(b.numel(), []).append(i)
    groups = []
    for numel, members in by_numel.items():
        per = max(1, _SORT_ELEMENTS // numel)
        groups += [members[first : first + per] for first in range(0, len(members), per)]
    return groups


def _sort_group(bases: list[torch.Tensor], rows: list[int]) -> _SortGroup:
    """The class order of same-size bases, one row each (`perm`: class-major position -> flat
    index; `hist`: elements per class), in one batched sort: a few sorts for a model's ~200
    tensors instead of one (and its dozen small ops) each."""
    numel = bases[rows[0]].numel()
    stacked = bases[rows[0]].reshape(1, -1) if len(rows) == 1 else torch.stack(
        [bases[i].reshape(-1) for i in rows])
    cls = classes(stacked)
    if cls.device.type == "cpu":  # numpy's stable sort of bytes is a radix sort, ~3x torch's here
        c = cls.numpy()
        perm = torch.from_numpy(np.argsort(c, axis=1, kind="stable"))
        hist = torch.from_numpy(np.stack([np.bincount(r, minlength=256) for r in c]).astype(np.int64))
    else:  # no host sync (CUDA's bincount has one): the class sizes from the sorted classes
        ordered, perm = torch.sort(cls, dim=1, stable=True)
        hist = _sizes(ordered, 256)
    return _SortGroup(rows, numel, perm, hist)


def _sizes(ordered: torch.Tensor, n: int) -> torch.Tensor:
    """How many of the values `ordered` (non-decreasing along its last dimension, all below n)
    equal 0 .. n-1, per row of a 2-D input, with no host sync (CUDA's bincount has one)."""
    rows = ordered.shape[:-1]
    values = torch.arange(n, device=ordered.device).to(ordered.dtype).expand(*rows, n).contiguous()
    end = torch.full((*rows, 1), ordered.shape[-1], dtype=torch.int64, device=ordered.device)
    return torch.diff(torch.cat([torch.searchsorted(ordered, values), end], -1), dim=-1)


def _bit_length(g: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative int64 values below 2**53 (frexp is exact there)."""
    return torch.frexp(g.to(torch.float64)).exponent.to(torch.int64)


def gap_symbols(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(symbol, extra-bit count, extra bits) of gaps g: g < 16 is its own symbol; else with
    b = bit length, symbol 16 + 2 (b - 5) + bit b-2 of g, and the low b - 2 bits raw."""
    b = _bit_length(g).clamp(min=5)
    big = g >= _LITERAL_GAPS
    nbits = torch.where(big, b - 2, 0)
    sym = torch.where(big, _LITERAL_GAPS + 2 * (b - 5) + ((g >> (b - 2)) & 1), g)
    return sym, nbits, g & ((1 << nbits) - 1)


def value_symbols(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(symbol, extra-bit count, extra bits) of zigzag deltas z >= 1: those of the gap z - 1 (the
    tail of many-ulp steps of tiny weights is long: a flat escape cost ~0.3 bit per change)."""
    return gap_symbols(z - 1)


def _from_symbols(
    sym: torch.Tensor, extra: Sequence[bytes | memoryview], what: list[str], counts: list[int] | None = None
) -> torch.Tensor:
    """Inverse of gap_symbols, reading the extra bits of each segment of `counts` symbols from
    its bytes (checked)."""
    big = sym >= _LITERAL_GAPS
    nbits = torch.where(big, (sym - _LITERAL_GAPS) // 2 + 3, 0)
    raw = unpack_bits(extra, nbits, what, counts)
    return torch.where(big, ((2 + ((sym - _LITERAL_GAPS) & 1)) << nbits) | raw, sym)


def normalise(counts: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of symbol weights -> frequencies summing to TOTAL, every `seen` symbol (default: weight
    > 0) >= 1: each gets 1 plus its floor share of the rest; the remainder goes to the symbol of
    the largest weight (the first if tied)."""
    seen = counts > 0 if seen is None else seen
    spare = TOTAL - seen.sum(1, keepdim=True)
    f = torch.where(seen, 1 + counts * spare // counts.sum(1, keepdim=True).clamp(min=1), 0)
    f[torch.arange(f.shape[0], device=f.device), counts.argmax(1)] += TOTAL - f.sum(1)
    return f


_Q_BITS = 31  # fixed point of the geometric model's ratio q (products of two fit 62 bits)


def _gap_bounds(device: torch.device) -> torch.Tensor:
    """lo of gap symbols 0..GAP_ALPHABET (the last: one past the alphabet): symbol s covers
    gaps [lo_s, lo_(s+1))."""
    s = torch.arange(GAP_ALPHABET + 1, dtype=torch.int64, device=device)
    b = (s - _LITERAL_GAPS) // 2 + 5
    return torch.where(s < _LITERAL_GAPS, s, (2 + ((s - _LITERAL_GAPS) & 1)) << (b - 2).clamp(min=0))


def gap_tables(changed: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """Gap frequencies (rows sum to TOTAL) of classes with `changed` of `size` elements changed:
    geometric gaps, q = 1 - changed/size, in integers only so that every decoder derives the same
    table (nothing of it is stored). Spec: docs/patch-format.md §4.1."""
    q = ((size - changed) << _Q_BITS) // size
    k = _gap_bounds(q.device)
    one = 1 << _Q_BITS
    surv = torch.full((q.numel(), k.numel()), one, dtype=torch.int64, device=q.device)
    power = q[:, None].expand_as(surv).clone()
    for j in range(45):  # q**k by squaring; k < 2**45
        bit = ((k >> j) & 1).bool()[None, :]
        surv = torch.where(bit, (surv * power) >> _Q_BITS, surv)
        power = (power * power) >> _Q_BITS
    surv = torch.cummin(surv, 1).values  # rounding must not make a probability negative
    mass = surv[:, :-1] - surv[:, 1:]
    possible = k[None, :-1] < size[:, None]  # a gap is below its class size
    return normalise(torch.where(possible, mass, 0), possible)


def lanes(n: int) -> int:
    return -(-n // LANE_STEPS)


# --- batched rANS over many streams -----------------------------------------------------------


@dataclass
class _Layout:
    """Where each symbol of each stream sits in the (step, lane) grid shared by all streams."""

    lane_first: list[int]  # per stream
    widths: list[int]  # lanes per stream
    total_lanes: int
    steps: int
    cell: torch.Tensor  # int64 per symbol (streams concatenated): step * total_lanes + lane


def _layout(counts: list[int], device: torch.device) -> _Layout:
    widths = [lanes(n) for n in counts]
    lane_first = [0]
    for w in widths[:-1]:
        lane_first.append(lane_first[-1] + w)
    total = sum(widths)
    steps = max((-(-n // w) for n, w in zip(counts, widths, strict=True) if n), default=0)
    n_all = torch.tensor(counts, dtype=torch.int64, device=device)
    stream = torch.repeat_interleave(torch.arange(len(counts), device=device), n_all, output_size=sum(counts))
    first_symbol = torch.cumsum(n_all, 0) - n_all
    k = torch.arange(sum(counts), device=device) - first_symbol[stream]
    width = torch.tensor(widths, dtype=torch.int64, device=device)[stream]
    lane = torch.tensor(lane_first, dtype=torch.int64, device=device)[stream] + k % width
    return _Layout(lane_first, widths, total, steps, (k // width) * total + lane)


def _grid(layout: _Layout, values: torch.Tensor, fill: int, bound: int) -> torch.Tensor:
    """(steps, lanes) grid of one value per symbol (fill elsewhere), all values and fill <= bound:
    ~2 cells per change of the patch, so int32 where they fit (halves the peak memory on a GPU)."""
    dtype = torch.int32 if bound < 1 << 31 else torch.int64
    grid = torch.full((layout.steps * layout.total_lanes,), fill, dtype=dtype, device=values.device)
    grid[layout.cell] = values.to(dtype)
    return grid.view(layout.steps, layout.total_lanes)


def ans_encode(
    symbols: torch.Tensor, tables: torch.Tensor, freq: torch.Tensor, counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rANS-code streams of `counts` symbols (concatenated in `symbols`, each with its table id in
    `tables`; `freq` rows sum to TOTAL). Returns, for all lanes of all streams in order (stream
    s has lanes(counts[s]) lanes): (final states, words per lane, words), words lane after lane,
    each lane's in the order its decoder reads them."""
    device = symbols.device
    layout = _layout(counts, device)
    cum = torch.cumsum(freq, 1) - freq
    # A cell without a symbol codes frequency TOTAL at 0, which leaves every state as it is
    # (never emits: x < TOTAL << 20 = 2**32): no masks in the loop.
    f_grid = _grid(layout, freq[tables, symbols], TOTAL, TOTAL)
    c_grid = _grid(layout, cum[tables, symbols], 0, TOTAL)
    x = torch.full((layout.total_lanes,), STATE_LOW, dtype=torch.int64, device=device)
    need = torch.zeros(layout.steps, layout.total_lanes, dtype=torch.bool, device=device)
    words = torch.zeros(layout.steps, layout.total_lanes, dtype=torch.int32, device=device)
    if _lanes_kernel_applies(device):  # one kernel, each lane's steps in a loop of its own
        _encode_lanes(x, f_grid, c_grid, need, words)
    else:
        g_grid = TOTAL - f_grid
        for t in range(layout.steps - 1, -1, -1):  # rANS encodes backwards
            f = f_grid[t]
            out = (x >> (32 - PREC)) >= f  # x >= f << 20, without shifting the int32 f
            need[t], words[t] = out, x & 0xFFFF
            x = torch.where(out, x >> 16, x)
            # ((x div f) << PREC) + (x mod f) + F_s, as x + (x div f)(TOTAL - f) + F_s
            x = x + torch.div(x, f, rounding_mode="floor") * g_grid[t] + c_grid[t]
    return x, need.sum(0), words.t()[need.t()]  # lane after lane, steps ascending within a lane


def ans_decode(
    states: torch.Tensor, lane_counts: torch.Tensor, words: torch.Tensor, tables: torch.Tensor,
    freq: torch.Tensor, counts: list[int], what: list[str],
) -> torch.Tensor:
    """Inverse of ans_encode: `states`, `lane_counts` of all streams' lanes and their `words`,
    concatenated in stream order; `tables` per symbol. Refuses streams whose lanes do not consume
    exactly their words or do not end in the encoder's initial state."""
    device = words.device
    layout = _layout(counts, device)
    n_tables = freq.shape[0]
    # Per (table, slot) one packed entry: symbol (7 bits) | f_s << 7 | (slot - F_s) << 20. An extra
    # last table, f = TOTAL at 0 for every slot, is the identity: cells without a symbol use it.
    freq = torch.cat([freq, torch.zeros(1, freq.shape[1], dtype=freq.dtype, device=device)])
    freq[-1, 0] = TOTAL
    symbol = torch.repeat_interleave(
        torch.arange(freq.shape[1], device=device).repeat(n_tables + 1), freq.reshape(-1),
        output_size=(n_tables + 1) * TOTAL,
    )  # table t's slot -> symbol, at t * TOTAL + slot
    slot = torch.arange(TOTAL, device=device).repeat(n_tables + 1)
    row = torch.arange(n_tables + 1, device=device).repeat_interleave(TOTAL)
    bias = slot - (torch.cumsum(freq, 1) - freq)[row, symbol]
    packed = symbol | (freq[row, symbol] << 7) | (bias << 20)
    base = _grid(layout, tables * TOTAL, n_tables * TOTAL, n_tables * TOTAL)
    ptr = torch.cumsum(lane_counts, 0) - lane_counts
    end = ptr + lane_counts
    # A lane reads at most one word a step: LANE_STEPS zeros past the end keep every read in bounds
    # (a lane that reads past its words is refused below).
    padded = torch.cat([words, words.new_zeros(LANE_STEPS + 1)])
    x = states.clone()
    bad_state = (states < STATE_LOW).any()
    out = torch.zeros(layout.steps, layout.total_lanes, dtype=torch.int16, device=device)  # symbol bits kept
    if _lanes_kernel_applies(device):  # one kernel, each lane's steps in a loop of its own
        _decode_lanes(x, ptr, padded, base, packed, out)
    else:  # every lane advances one step per batch of torch ops
        for t in range(layout.steps):
            e = torch.index_select(packed, 0, base[t] + (x & (TOTAL - 1)))
            xn = ((e >> 7) & 0x1FFF) * (x >> PREC) + (e >> 20)
            take = xn < STATE_LOW
            w = torch.index_select(padded, 0, ptr)
            ptr += take
            x = torch.where(take, (xn << 16) | w, xn)
            out[t] = e
    out = out.to(torch.int64) & 0x7F
    bad_lane = (ptr != end) | (x != STATE_LOW) | bad_state
    if bool(bad_lane.any()):
        lane = int(torch.nonzero(bad_lane)[0])
        stream = max(i for i, first in enumerate(layout.lane_first) if first <= lane and layout.widths[i])
        raise CorruptPatchError(f"{what[stream]}: rANS lane {lane - layout.lane_first[stream]} is corrupt")
    return out.view(-1)[layout.cell] if layout.steps else torch.zeros(0, dtype=torch.int64, device=device)


# On a GPU the step loops above cost ~8 kernel launches a step (1024 steps: most of a 1.7B patch's
# encode or decode); one Triton program per block of lanes runs the same arithmetic with the steps
# in a loop of its own.
_LANES_PER_PROGRAM = 128


def _lanes_kernel_applies(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["steps", "lanes"])
    def _decode_lanes_kernel(x_ptr, word_at_ptr, words_ptr, base_ptr, packed_ptr, out_ptr, steps, lanes,
                             BLOCK: tl.constexpr, PREC_: tl.constexpr, STATE_LOW_: tl.constexpr):
        lane = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        ok = lane < lanes
        x = tl.load(x_ptr + lane, mask=ok, other=STATE_LOW_)
        at = tl.load(word_at_ptr + lane, mask=ok, other=0)
        base_at, out_at = base_ptr + lane, out_ptr + lane  # row t of the (steps, lanes) grids
        for _ in range(steps):
            table = tl.load(base_at, mask=ok, other=0).to(tl.int64)
            e = tl.load(packed_ptr + table + (x & ((1 << PREC_) - 1)), mask=ok, other=0)
            xn = ((e >> 7) & 0x1FFF) * (x >> PREC_) + (e >> 20)
            take = (xn < STATE_LOW_) & ok
            w = tl.load(words_ptr + at, mask=take, other=0).to(tl.int64)
            at += take.to(tl.int64)
            x = tl.where(take, (xn << 16) | w, xn)
            tl.store(out_at, e.to(tl.int16), mask=ok)
            base_at += lanes
            out_at += lanes
        tl.store(x_ptr + lane, x, mask=ok)
        tl.store(word_at_ptr + lane, at, mask=ok)

    @triton.jit(do_not_specialize=["steps", "lanes"])
    def _encode_lanes_kernel(x_ptr, f_ptr, c_ptr, need_ptr, words_ptr, steps, lanes,
                             BLOCK: tl.constexpr, PREC_: tl.constexpr, TOTAL_: tl.constexpr):
        lane = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        ok = lane < lanes
        x = tl.load(x_ptr + lane, mask=ok, other=0)
        at = (steps - 1).to(tl.int64) * lanes + lane  # row t of the (steps, lanes) grids, last first
        for _ in range(steps):
            f = tl.load(f_ptr + at, mask=ok, other=TOTAL_).to(tl.int64)
            c = tl.load(c_ptr + at, mask=ok, other=0).to(tl.int64)
            out = (x >> (32 - PREC_)) >= f
            tl.store(need_ptr + at, out, mask=ok)
            tl.store(words_ptr + at, (x & 0xFFFF).to(tl.int32), mask=ok)
            x = tl.where(out, x >> 16, x)
            x = x + (x // f) * (TOTAL_ - f) + c
            at -= lanes
        tl.store(x_ptr + lane, x, mask=ok)


def _encode_lanes(x: torch.Tensor, f_grid: torch.Tensor, c_grid: torch.Tensor, need: torch.Tensor,
                  words: torch.Tensor) -> None:
    """The torch loop of ans_encode in one kernel: every lane through all its steps, last first, in
    place (`x`: states), marking in `need` (steps, lanes) where a word is emitted and its value in
    `words`."""
    steps, lanes = need.shape
    if not steps or not lanes:
        return
    _encode_lanes_kernel[(triton.cdiv(lanes, _LANES_PER_PROGRAM),)](
        x, f_grid.contiguous(), c_grid.contiguous(), need, words, steps, lanes,
        BLOCK=_LANES_PER_PROGRAM, PREC_=PREC, TOTAL_=TOTAL, num_warps=4)


def _decode_lanes(x: torch.Tensor, word_at: torch.Tensor, words: torch.Tensor, base: torch.Tensor,
                  packed: torch.Tensor, out: torch.Tensor) -> None:
    """The torch loop of ans_decode in one kernel: advances every lane through all its steps, in
    place (`x`: states, `word_at`: each lane's next word), writing each step's packed entry (its
    low 16 bits: the symbol is in the low 7) to `out` (steps, lanes)."""
    steps, lanes = out.shape
    if not steps or not lanes:
        return
    _decode_lanes_kernel[(triton.cdiv(lanes, _LANES_PER_PROGRAM),)](
        x, word_at, words.to(torch.int64), base.contiguous(), packed.to(torch.int64), out, steps, lanes,
        BLOCK=_LANES_PER_PROGRAM, PREC_=PREC, STATE_LOW_=STATE_LOW, num_warps=4)


# --- raw extra bits -----------------------------------------------------------------------------


def _segments(nbits: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(bit offset of each field, bits of each segment) for consecutive segments of `counts`
    fields, each segment starting on a whole byte. One host sync."""
    device = nbits.device
    n = torch.tensor(counts, dtype=torch.int64, device=device)
    segment = torch.repeat_interleave(torch.arange(len(counts), device=device), n, output_size=sum(counts))
    # Segments are contiguous: their sums from one running sum (an index_add of every field into a
    # few hundred segments serialises on atomics: 27 ms for a 1.7B patch on an H100).
    running = torch.cat([nbits.new_zeros(1), torch.cumsum(nbits, 0)])
    ends = torch.cumsum(n, 0)
    seg_bits = running[ends] - running[ends - n]
    bits_before = torch.cumsum(seg_bits, 0) - seg_bits
    seg_bytes = (seg_bits + 7) // 8
    byte_start = torch.cumsum(seg_bytes, 0) - seg_bytes
    offset = torch.cumsum(nbits, 0) - nbits - bits_before[segment] + 8 * byte_start[segment]
    return offset, seg_bits.tolist()


def pack_bits(values: torch.Tensor, nbits: torch.Tensor, counts: list[int] | None = None) -> list[bytes]:
    """The low nbits (<= 42) of each value, least significant bit first (bit p is bit p % 8 of
    byte p // 8), zero-padded to a whole byte, for each segment of `counts` fields (default:
    one segment of all)."""
    counts = [nbits.numel()] if counts is None else counts
    offset, seg_bits = _segments(nbits, counts)
    seg_bytes = [-(-b // 8) for b in seg_bits]
    out = torch.zeros(sum(seg_bytes) + 7, dtype=torch.int64, device=values.device)
    # Fields never overlap, so adding their bytes is OR-ing them. Only fields that reach byte j of
    # their window add to it: most fields are empty or fit one byte, and every add is an atomic
    # (7 passes over every field cost ~70 ms for a 1.7B patch on an H100).
    has = torch.nonzero(nbits).view(-1)
    byte = (offset >> 3)[has]
    shifted = ((values & ((1 << nbits) - 1)) << (offset & 7))[has]
    reach = ((offset & 7) + nbits)[has]  # bits from the field's first byte to its end
    for j in range(7):
        if j:
            further = torch.nonzero(reach > 8 * j).view(-1)
            if not further.numel():
                break
            byte, shifted, reach = byte[further], shifted[further], reach[further]
        out.index_add_(0, byte + j, (shifted >> (8 * j)) & 0xFF)
    data = out[: sum(seg_bytes)].to(torch.uint8).cpu().numpy().tobytes()
    bounds = np.cumsum([0, *seg_bytes]).tolist()
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def unpack_bits(
    data: Sequence[bytes | memoryview], nbits: torch.Tensor, what: list[str], counts: list[int] | None = None
) -> torch.Tensor:
    """Inverse of pack_bits; refuses a segment of the wrong byte count or with non-zero padding
    bits (above the last field, in the segment's last byte)."""
    counts = [nbits.numel()] if counts is None else counts
    offset, seg_bits = _segments(nbits, counts)
    for name, raw, n_bits in zip(what, data, seg_bits, strict=True):
        if len(raw) != -(-n_bits // 8):
            raise CorruptPatchError(f"{name}: {len(raw)} bytes of extra bits, symbols need {-(-n_bits // 8)}")
        if n_bits % 8 and raw[-1] >> (n_bits % 8):
            raise CorruptPatchError(f"{name}: non-zero padding bits")
    joined = bytearray(b"".join(data)) + bytes(7)  # 7 zero bytes: every field's 7-byte window is in bounds
    # The bytes go to the device as bytes and are widened there (int64 on the host: 8x the copy).
    buf = torch.frombuffer(joined, dtype=torch.uint8).to(nbits.device).to(torch.int64)
    at = offset >> 3
    window = torch.zeros_like(nbits)
    for j in range(7):
        window |= torch.index_select(buf, 0, at + j) << (8 * j)
    return (window >> (offset & 7)) & ((1 << nbits) - 1)


# --- tensor streams -----------------------------------------------------------------------------


@dataclass
class CtxInput:
    """One bf16 tensor's change, as ctxans needs it: the whole base (int16 view) and the changes."""

    base_bits: torch.Tensor
    indices: torch.Tensor  # sorted flat int64
    zigzag: torch.Tensor  # zigzag of the signed bit delta, >= 1


@dataclass
class _Symbols:
    per_class: torch.Tensor  # (256,) changes per class
    hist: torch.Tensor  # (256,) base elements per class
    ctx: torch.Tensor  # per change (class-major order): index into the used classes
    gap: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    value: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _symbols_all(items: list[CtxInput]) -> list[_Symbols]:
    """Gap and value symbols of each tensor's changes in class-major order (no host sync), tensors
    of one size together (_size_groups), one group's class order in memory at a time."""
    bases = [it.base_bits for it in items]
    found: dict[int, _Symbols] = {}
    for rows in _size_groups(bases):
        symbols = _group_symbols(_sort_group(bases, rows), [items[i] for i in rows])
        found.update(zip(rows, symbols, strict=True))
    return [found[i] for i in range(len(items))]


def _group_symbols(group: _SortGroup, items: list[CtxInput]) -> list[_Symbols]:
    """_symbols_all for one group: every row's changes at once, as global class-major positions
    G = row * numel + s (ascending: rows in turn, class-major within a row)."""
    n, k = group.numel, len(items)
    device = group.perm.device
    counts = [it.indices.numel() for it in items]
    total = sum(counts)
    row = torch.repeat_interleave(torch.arange(k, device=device), torch.tensor(counts, device=device),
                                  output_size=total)
    key = torch.cat([it.indices for it in items]) + row * n  # ascending: each row's indices are sorted
    mask = torch.zeros(k * n, dtype=torch.bool, device=device)
    mask[key] = True
    g = torch.nonzero_static(torch.gather(mask.view(k, n), 1, group.perm).view(-1), size=total).view(-1)
    row = g // n
    flat = group.perm.view(-1)[g]
    z = torch.cat([it.zigzag for it in items])[torch.searchsorted(key, row * n + flat)]
    starts = (torch.cumsum(group.hist, 1) - group.hist + torch.arange(k, device=device)[:, None] * n).view(-1)
    klass = torch.searchsorted(starts, g, right=True) - 1  # row * 256 + class, non-decreasing
    # A class with no element shares its start with the next: searchsorted (right) takes the last
    # of equal starts, the one class that holds position g.
    rank = g - starts[klass]
    new_class = torch.ones_like(klass, dtype=torch.bool)
    new_class[1:] = klass[1:] != klass[:-1]
    prev = torch.cat([rank.new_full((1,), -1), rank[:-1]])
    gap = torch.where(new_class, rank, rank - prev - 1)
    per_class = _sizes(klass, k * 256).view(k, 256)
    ctx = (torch.cumsum(per_class > 0, 1) - 1).view(-1)[klass]
    gaps, values = gap_symbols(gap), value_symbols(z)
    parts = [x.split(counts) for x in (ctx, *gaps, *values)]
    return [_Symbols(per_class[r], group.hist[r], parts[0][r], (parts[1][r], parts[2][r], parts[3][r]),
                     (parts[4][r], parts[5][r], parts[6][r])) for r in range(k)]


def _headers(heads: list[list[torch.Tensor]]) -> list[bytes]:
    """Per stream, u32 count then the LEB128 values of its tensors (§3's rules): every stream's in
    one numpy pass (a few hundred values per stream, a few hundred streams: per-stream calls cost
    more than the coding)."""
    sizes = [sum(t.numel() for t in head) for head in heads]
    v = np.concatenate([t.reshape(-1).cpu().numpy().astype(np.uint64) for head in heads for t in head])
    n_bytes = np.ones(v.size, dtype=np.int64)
    for k in range(1, 9):
        n_bytes += v >= np.uint64(1 << (7 * k))
    starts = np.cumsum(n_bytes) - n_bytes
    out = np.zeros(int(n_bytes.sum()), dtype=np.uint8)
    for k in range(int(n_bytes.max(initial=1))):
        sel = n_bytes > k
        group = (v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)
        out[starts[sel] + k] = group | (n_bytes[sel] > k + 1).astype(np.uint64) << np.uint64(7)
    data = out.tobytes()
    ends = np.cumsum(np.add.reduceat(n_bytes, np.cumsum([0, *sizes[:-1]])) if v.size else [0] * len(heads))
    bounds = [0, *ends.tolist()]
    return [_U32.pack(n) + data[bounds[j] : bounds[j + 1]] for j, n in enumerate(sizes)]


def _varints(streams: list[memoryview], what: list[str]) -> list[tuple[list[int], int]]:
    """Per stream: (the LEB128 values its u32 count declares, the header's bytes, count included),
    every stream's in one numpy pass; refuses a stream shorter than its count, a header holding
    fewer varints than it declares, and encodings over-long or longer than 9 bytes (§3), naming
    the first such stream."""
    for data, name in zip(streams, what, strict=True):
        if len(data) < 4:
            raise CorruptPatchError(f"{name}: shorter than its header")
    counts = np.array([_U32.unpack(data[:4])[0] for data in streams], dtype=np.int64)
    heads = [np.frombuffer(data[4 : 4 + 9 * int(c)], dtype=np.uint8)
             for data, c in zip(streams, counts, strict=True)]
    head = np.concatenate(heads) if heads else np.zeros(0, dtype=np.uint8)
    region_end = np.cumsum([h.size for h in heads], dtype=np.int64)
    region_start = region_end - [h.size for h in heads]
    term = np.flatnonzero(head < 0x80)
    first = np.searchsorted(term, region_start)
    short = (counts == 0) | (np.searchsorted(term, region_end) - first < counts)
    if short.any():
        name = what[int(np.flatnonzero(short)[0])]
        raise CorruptPatchError(f"{name}: header holds fewer varints than it declares")
    stream = np.repeat(np.arange(len(streams)), counts)
    value_first = np.cumsum(counts) - counts
    ends = term[first[stream] + np.arange(int(counts.sum())) - value_first[stream]]
    starts = np.concatenate([[0], ends[:-1] + 1])
    starts[value_first] = region_start  # each stream's first value starts its region
    lengths = ends - starts + 1
    for bad, problem in ((lengths > 9, "varint longer than 9 bytes in the header"),
                         ((lengths > 1) & (head[ends] == 0),
                          "over-long varint (last byte 0x00) in the header")):
        if bad.any():
            raise CorruptPatchError(f"{what[int(stream[np.flatnonzero(bad)[0]])]}: {problem}")
    values = np.zeros(ends.size, dtype=np.uint64)
    for k in range(int(lengths.max(initial=1))):
        sel = lengths > k
        values[sel] |= (head[starts[sel] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    per_stream = np.split(values, np.cumsum(counts)[:-1])
    last_end = ends[np.cumsum(counts) - 1] - region_start
    return [(v.tolist(), 4 + int(e) + 1) for v, e in zip(per_stream, last_end, strict=True)]


def _table_varints(f: torch.Tensor) -> torch.Tensor:
    """Each row as m (1 + its last non-zero column) followed by its first m frequencies."""
    cols = torch.arange(f.shape[1], device=f.device)
    m = ((f > 0) * (cols + 1)).amax(1)
    keep = torch.cat([torch.ones(f.shape[0], 1, dtype=torch.bool, device=f.device), cols < m[:, None]], 1)
    return torch.cat([m[:, None], f], 1)[keep]


def _value_tables(hists: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(value tables, table of each class) of each tensor, from its per-class symbol counts
    (K, A): a class gets its own table when that saves more than the table costs (~12 bits an
    entry, estimated), the others share one pooled table, first (the writer's choice: any
    assignment decodes). Every tensor's classes at once."""
    hist = torch.cat(hists)
    k = torch.tensor([h.shape[0] for h in hists])
    tensor = torch.repeat_interleave(torch.arange(len(hists)), k)
    counts = hist.to(torch.float64)
    n = counts.sum(1, keepdim=True)
    own_bits = -(counts * torch.log2(torch.where(counts > 0, counts / n, 1))).sum(1)
    pooled = torch.zeros(len(hists), hist.shape[1], dtype=torch.float64).index_add_(0, tensor, counts) + 0.5
    pooled_bits = -(counts * torch.log2(pooled / pooled.sum(1, keepdim=True))[tensor]).sum(1)
    entries = ((hist > 0) * torch.arange(1, hist.shape[1] + 1)).amax(1) + 1
    own = own_bits + 12 * entries < pooled_bits
    # Per tensor: the pooled row of the classes without their own table (if any), then own rows.
    shared_rows = torch.zeros(len(hists), hist.shape[1], dtype=torch.int64).index_add_(
        0, tensor[~own], hist[~own])
    has_pool = torch.zeros(len(hists), dtype=torch.int64).index_add_(0, tensor, (~own).long()) > 0
    own_before = torch.cumsum(own.long(), 0) - own.long()
    first_class = torch.cumsum(k, 0) - k
    own_rank = own_before - own_before[first_class][tensor]  # own classes before it, in its tensor
    value_of = torch.where(own, has_pool.long()[tensor] + own_rank, 0)
    rows_of = has_pool.long() + torch.zeros(len(hists), dtype=torch.int64).index_add_(0, tensor, own.long())
    # Rows in tensor order, a tensor's pooled row before its own rows (those in class order).
    span = 2 * hist.shape[0] + 2
    key = torch.cat([tensor[own] * span + 2 * torch.arange(hist.shape[0])[own] + 1,
                     torch.nonzero(has_pool).view(-1) * span])
    rows = torch.cat([hist[own], shared_rows[has_pool]])[torch.argsort(key)]
    tables = normalise(rows).split(rows_of.tolist()) if rows.shape[0] else []
    return list(tables), list(value_of.split(k.tolist()))


def encode_tensors(items: list[CtxInput]) -> list[tuple[bytes, bytes]]:
    """(index stream, payload stream) of each tensor, coded together: one rANS pass and a fixed
    number of host syncs for all tensors."""
    if not items:
        return []
    device = items[0].base_bits.device
    syms = _symbols_all(items)
    per_class = torch.stack([s.per_class for s in syms]).cpu()
    sizes_all = torch.stack([s.hist for s in syms]).cpu()
    used = [torch.nonzero(row).view(-1) for row in per_class]
    counts = [per_class[i][u] for i, u in enumerate(used)]
    sizes = torch.cat([sizes_all[i][u] for i, u in enumerate(used)])
    gap_f = list(gap_tables(torch.cat(counts).to(device), sizes.to(device)).split([u.numel() for u in used]))
    hists = torch.cat([
        torch.zeros(u.numel() * VALUE_ALPHABET, dtype=torch.int64, device=device).index_add_(
            0, s.ctx * VALUE_ALPHABET + s.value[0], torch.ones_like(s.ctx))
        for s, u in zip(syms, used, strict=True)
    ]).cpu().split([u.numel() * VALUE_ALPHABET for u in used])
    value_f, value_of = _value_tables([h.view(u.numel(), VALUE_ALPHABET)
                                       for h, u in zip(hists, used, strict=True)])
    tables, base = [], 0
    for f, s in zip(gap_f, syms, strict=True):
        tables.append(s.ctx + base)
        base += f.shape[0]
    for f, s, table in zip(value_f, syms, value_of, strict=True):
        tables.append(table.to(device)[s.ctx] + base)
        base += f.shape[0]
    value_wide = torch.zeros(base - sum(f.shape[0] for f in gap_f), GAP_ALPHABET, dtype=torch.int64)
    value_wide[:, :VALUE_ALPHABET] = torch.cat(value_f)
    freq = torch.cat([*gap_f, value_wide.to(device)])
    n = len(items)
    stream_counts = [s.ctx.numel() for s in syms] * 2
    states, per_lane, words = ans_encode(
        torch.cat([s.gap[0] for s in syms] + [s.value[0] for s in syms]), torch.cat(tables), freq,
        stream_counts,
    )
    extras = pack_bits(torch.cat([s.gap[2] for s in syms] + [s.value[2] for s in syms]),
                       torch.cat([s.gap[1] for s in syms] + [s.value[1] for s in syms]), stream_counts)
    states_np = states.cpu().numpy().astype("<u4")
    per_lane_np = per_lane.cpu().numpy()
    words_np = words.cpu().numpy().astype("<u2")
    lane_at = np.cumsum([0, *[lanes(c) for c in stream_counts]])
    word_at = np.concatenate([[0], np.cumsum(per_lane_np)])
    heads = []
    for j in range(len(stream_counts)):
        i = j % n
        lane_counts = torch.from_numpy(per_lane_np[int(lane_at[j]) : int(lane_at[j + 1])])
        if j < n:
            heads.append([torch.tensor([used[i].numel()]), used[i], counts[i], lane_counts])
        else:
            heads.append([torch.tensor([value_f[i].shape[0]]), _table_varints(value_f[i]), value_of[i],
                          lane_counts])
    streams = []
    for j, header in enumerate(_headers(heads)):
        a, b = int(lane_at[j]), int(lane_at[j + 1])
        streams.append(b"".join([
            header, states_np[a:b].tobytes(), words_np[int(word_at[a]) : int(word_at[b])].tobytes(),
            extras[j],
        ]))
    return list(zip(streams[:n], streams[n:], strict=True))


# --- decoding -----------------------------------------------------------------------------------


class _Reader:
    """The varint header, lane states and words of one ctxans stream, checked as it goes."""

    def __init__(self, data: memoryview, what: str, values: list[int], header_bytes: int):
        self.data, self.what, self.values, self.at = data, what, values, header_bytes  # from _varints
        self.next = 0

    def ints(self, n: int) -> list[int]:
        if self.next + n > len(self.values):
            raise CorruptPatchError(f"{self.what}: header ends early")
        out = self.values[self.next : self.next + n]
        self.next += n
        return out

    def table(self, alphabet: int) -> list[int]:
        (m,) = self.ints(1)
        if not 1 <= m <= alphabet:
            raise CorruptPatchError(f"{self.what}: table of {m} symbols (alphabet {alphabet})")
        f = self.ints(m)
        if sum(f) != TOTAL or f[-1] == 0:
            raise CorruptPatchError(f"{self.what}: table does not sum to {TOTAL} or ends in a zero")
        return f + [0] * (GAP_ALPHABET - m)

    def body(self, width: int) -> tuple[list[int], memoryview, memoryview, memoryview]:
        """(lane word counts, states, words, the rest = extra bits) once the tables are read."""
        lane_counts = self.ints(width)
        if self.next != len(self.values):
            raise CorruptPatchError(f"{self.what}: header holds more varints than its fields")
        n_words = sum(lane_counts)
        states_end = self.at + 4 * width
        words_end = states_end + 2 * n_words
        if len(self.data) < words_end:
            raise CorruptPatchError(f"{self.what}: stream shorter than its lanes")
        rest = self.data[words_end:]
        return lane_counts, self.data[self.at : states_end], self.data[states_end:words_end], rest


@dataclass
class CtxStreams:
    """One entry's two ctxans streams and its base tensor (the decoder's context)."""

    name: str
    count: int
    index: bytes | memoryview
    payload: bytes | memoryview
    base: torch.Tensor  # int16 view of the base bf16 tensor, flat


@dataclass
class _Parsed:
    used: list[int]
    class_counts: list[int]
    value_tables: list[list[int]]
    value_of: list[int]  # per used class: its value table
    bodies: list[tuple[list[int], memoryview, memoryview, memoryview]]  # index, payload


def _parse_all(items: list[CtxStreams]) -> list[_Parsed]:
    """Every entry's two stream headers (host only, their varints in one pass), each checked as far
    as it goes without the base."""
    for it in items:
        if not supports("bfloat16", it.base.numel()):
            raise TensorMismatchError(f"{it.name}: ctxans needs a bfloat16 tensor below 2**31 elements")
    streams = [memoryview(data) for it in items for data in (it.index, it.payload)]
    what = [f"{it.name}: {kind} stream" for it in items for kind in ("index", "payload")]
    heads = _varints(streams, what)
    return [_parse(it, *(_Reader(streams[j], what[j], *heads[j]) for j in (2 * i, 2 * i + 1)))
            for i, it in enumerate(items)]


def _parse(it: CtxStreams, r: _Reader, payload: _Reader) -> _Parsed:
    """Both streams' headers of one entry, checked as far as they go without the base."""
    what = r.what
    (k,) = r.ints(1)
    if not 1 <= k <= 256:
        raise CorruptPatchError(f"{what}: {k} classes")
    used, class_counts = r.ints(k), r.ints(k)
    if any(b <= a for a, b in zip(used, used[1:], strict=False)) or used[-1] > 255:
        raise CorruptPatchError(f"{what}: classes not strictly increasing below 256")
    if min(class_counts) < 1 or sum(class_counts) != it.count:
        raise CorruptPatchError(f"{what}: class counts do not sum to the entry's count")
    index_body = r.body(lanes(it.count))
    r, what = payload, payload.what
    (n_tables,) = r.ints(1)
    if not 1 <= n_tables <= k:
        raise CorruptPatchError(f"{what}: {n_tables} value tables for {k} classes")
    value_tables = [r.table(VALUE_ALPHABET) for _ in range(n_tables)]
    value_of = r.ints(k)
    if set(value_of) != set(range(n_tables)):
        raise CorruptPatchError(f"{what}: a class names a missing value table, or a table is unused")
    return _Parsed(used, class_counts, value_tables, value_of, [index_body, r.body(lanes(it.count))])


def _device_ints(raw: Sequence[bytes | memoryview], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The little-endian integers of `dtype` (int16: u16 words, int32: u32 states) in the joined
    byte strings, as int64 on `device`: one copy of the narrow bytes, widened there (widening on
    the host and copying int64 cost ~4x the bytes)."""
    joined = bytearray(b"".join(raw))
    narrow = torch.frombuffer(joined, dtype=dtype) if joined else torch.zeros(0, dtype=dtype)
    mask = (1 << (8 * narrow.element_size())) - 1
    return narrow.to(device).to(torch.int64) & mask


def decode_tensors(items: list[CtxStreams]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sorted flat indices, zigzag deltas) of each entry, validated against its base tensor (int16
    view). Every step runs on all entries at once, whatever their number: the classes of
    same-size bases in one sort, the rANS lanes of every stream in one pass, the ranks, positions
    and checks over the concatenation of all entries' changes (entries are taken in the order of
    their sort groups inside, and returned in the caller's), with a fixed number of host syncs."""
    if not items:
        return []
    device = items[0].base.device
    parsed_in_order = _parse_all(items)
    bases = [it.base for it in items]
    groups = [_sort_group(bases, rows) for rows in _size_groups(bases)]
    order = [i for g in groups for i in g.members]  # working position -> the caller's position
    items, parsed = [items[i] for i in order], [parsed_in_order[i] for i in order]
    n_items = len(items)
    hist = torch.cat([g.hist for g in groups]).to(device)  # (entries, 256)
    per_item = torch.tensor([len(p.used) for p in parsed], dtype=torch.int64)
    flat_lists = torch.tensor([v for p in parsed for v in (*p.used, *p.class_counts, *p.value_of)],
                              dtype=torch.int64).to(device)
    sections = [x for p in parsed for x in (len(p.used),) * 3]
    parts = flat_lists.split(sections)
    used = torch.cat(parts[0::3])  # every entry's used classes, entry after entry
    counts = torch.cat(parts[1::3])
    value_of = torch.cat(parts[2::3])
    n_classes = used.numel()
    item_of_class = torch.repeat_interleave(torch.arange(n_items), per_item).to(device)
    sizes = hist[item_of_class, used]
    _refuse_segments(items, order, counts > sizes, per_item.tolist(),
                     "index stream: more changes in a class than the base has elements in it")
    gap_f = gap_tables(counts, sizes)
    change_counts = [it.count for it in items]
    total = sum(change_counts)
    ctx = torch.repeat_interleave(torch.arange(n_classes, device=device), counts, output_size=total)
    n_value_tables = torch.tensor([len(p.value_tables) for p in parsed], dtype=torch.int64, device=device)
    value_base = torch.cumsum(n_value_tables, 0) - n_value_tables
    value_table = value_of + value_base[item_of_class] + n_classes  # per class: its row of freq
    value_f = torch.tensor([t for p in parsed for t in p.value_tables], dtype=torch.int64, device=device)
    bodies = [p.bodies[kind] for kind in (0, 1) for p in parsed]
    what = [f"{it.name}: {kind} stream" for kind in ("index", "payload") for it in items]
    stream_counts = change_counts * 2
    symbols = ans_decode(
        _device_ints([b[1] for b in bodies], torch.int32, device),
        torch.tensor([c for b in bodies for c in b[0]], dtype=torch.int64, device=device),
        _device_ints([b[2] for b in bodies], torch.int16, device), torch.cat([ctx, value_table[ctx]]),
        torch.cat([gap_f, value_f]), stream_counts, what,
    )
    values = _from_symbols(symbols, [b[3] for b in bodies], what, stream_counts)
    gaps, z = values[:total], values[total:] + 1
    _refuse_segments(items, order, z > 0xFFFF, change_counts, "payload stream holds a delta beyond 16 bits")
    class_size = sizes[ctx]
    _refuse_segments(items, order, gaps >= class_size, change_counts,
                     "index stream gap beyond the base's class size")  # so no sum below reaches 2**63
    ranks = _ranks(gaps, ctx, counts)
    _refuse_segments(items, order, ranks >= class_size, change_counts,
                     "index stream ranks beyond the base's class sizes")
    item_of_change = item_of_class[ctx]
    starts = torch.cumsum(hist, 1) - hist
    position = starts[item_of_change, used[ctx]] + ranks  # class-major position within its entry
    row_of_item = torch.tensor([r for g in groups for r in range(len(g.members))], dtype=torch.int64,
                               device=device)
    flat = torch.empty_like(position)
    a = first_item = 0
    for g in groups:  # the group's entries are consecutive here: one gather each
        b = a + sum(change_counts[first_item : first_item + len(g.members)])
        flat[a:b] = g.perm.view(-1)[row_of_item[item_of_change[a:b]] * g.numel + position[a:b]]
        a, first_item = b, first_item + len(g.members)
    # Ascending flat index within each entry, entries in turn: one sort (a flat index < 2**31).
    key, at = torch.sort((item_of_change << 31) | flat)
    flat_sorted = (key & ((1 << 31) - 1)).split(change_counts)
    z_sorted = z[at].split(change_counts)
    here = {caller: i for i, caller in enumerate(order)}  # the caller's position -> working position
    return [(flat_sorted[here[i]], z_sorted[here[i]]) for i in range(n_items)]


def _refuse_segments(items: list[CtxStreams], order: list[int], bad: torch.Tensor, lengths: list[int],
                     what: str) -> None:
    """One host sync for a check over every entry's consecutive `lengths` elements of `bad`; raise
    for the entry that fails it first in the caller's order (`order`: working -> caller's)."""
    length = torch.tensor(lengths, dtype=torch.int64, device=bad.device)
    ends = torch.cumsum(length, 0)
    running = torch.cat([bad.new_zeros(1, dtype=torch.int64), torch.cumsum(bad.to(torch.int64), 0)])
    failed = torch.nonzero(running[ends] - running[ends - length]).view(-1).tolist()
    if failed:
        raise CorruptPatchError(f"{items[min(failed, key=lambda i: order[i])].name}: {what}")


def _ranks(gap: torch.Tensor, ctx: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rank within the class of each change: cumulative (gap + 1), restarted at each class."""
    step = gap + 1
    csum = torch.cumsum(step, 0)
    return csum - (csum - step)[torch.cumsum(counts, 0) - counts][ctx] - 1

