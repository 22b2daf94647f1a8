"""Triton grouped GEMMs for our prefill MoE path (`prefill_moe.py`): the rows of each expert of a tile, found on
the device, against that expert's decoded fp16 weights. No host sync, graph safe. Two formulations:

Folded (weights decoded by `reconstruct_had_batch` into the real basis, W = diag(suh) H W_hat H diag(svh)), two
kernels per tile:
- `gate_up`: for the rows of each expert b of the tile, gate = x @ Wg[b] and up = x @ Wu[b] in one main loop (the
  input rows gathered by token id in the loads), then act = SiLU(gate) * up with exllamav3's clamp
  (`act_limit`: SiLU from above, up symmetrically), stored fp16 at the rows' sorted positions.
- `down`: y = act @ Wd[b], times the row's routing weight, added into the fp32 output row of its token
  (atomic adds: a token's k experts arrive in any order, as exl3_moe's do).

Unfolded (weights decoded by `reconstruct_batch` in the rotated basis, W_hat exact in fp16; the rotations on the
activations, as exllamav3's exl3_gemm and exl3_moe apply them: y = ((x * suh) H) W_hat H * svh):
- `rotate_in`, once per call: every routed row's input rotated into gate's and up's bases
  (had(x[token] * suh_e), fp16), at the row's sorted position;
- `gate_up_rot`: both GEMMs, then in the epilogue each output block of 128 columns (one Hadamard block) rotated
  back (had, * svh), the activation, and the activation rotated into down's basis (had(act * suh_d));
- `down_rot`: the GEMM, rotated back (had, * svh_d), weighted and added as in `down`.
The Hadamards are tensor-core products with the +-1 matrix, of the value rounded to fp16 where exllamav3 rounds it
(rotated inputs, gate and up outputs, the activation) and of down's fp32 accumulator as two fp16 halves (hi + lo),
which exllamav3 keeps in fp32: the activations round where exllamav3's do.

Which rows belong to which expert is read on the device (`counts`, `starts` over the expert-sorted
assignments), so the launch shape is fixed: one program per (expert, row block, column block) up to T rows (the
unfolded kernels cap the row programs and loop, `ROW_PROGRAMS`), or a persistent grid walking the items (folded
only). Imports Triton on first use only (plugin import stays cheap).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from glm53_overlay.exl3.hadamard import HADAMARD_BLOCK, hadamard_128, rotate_cols

# (rows, columns, k) per block, warps, pipeline stages; measured on the H200 (benchmarks/results/prefill/).
GATE_UP_BLOCK = (64, 64, 64, 4, 3)
DOWN_BLOCK = (64, 64, 64, 4, 3)
# Persistent grid (programs walk the items) or one program per possible item; persistent programs per SM.
PERSISTENT = False
PROGRAMS_PER_SM = 2
# Unfolded kernels: (rows, k) per block, warps, stages; the columns are one Hadamard block (128).
ROT_GATE_UP_BLOCK = (128, 64, 8, 3)
ROT_DOWN_BLOCK = (64, 64, 4, 3)
# Row programs per (expert, column block) of the unfolded kernels. Without a cap the grid has T / BM of them, and at
# 8192 tokens over 90% find no rows (an expert averages T * k / E = 228): those still cost a block launch each.
ROW_PROGRAMS = 4
# Rows per program of the input rotation.
ROTATE_ROWS = 64
HADAMARD_SCALE = HADAMARD_BLOCK**-0.5


@lru_cache(maxsize=1)
def kernels() -> Any:  # Triton JIT kernels: CUDA only
    import triton
    import triton.language as tl

    @triton.jit
    def gate_up_item(x_ptr, tok_ptr, wg_base, wu_base, act_ptr, start, cnt, mb, nb, act_limit,
                     H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     HAS_LIMIT: tl.constexpr, STAGES: tl.constexpr):
        rows = mb * BM + tl.arange(0, BM)
        rmask = rows < cnt
        r = start + rows
        tok = tl.load(tok_ptr + r, mask=rmask, other=0).to(tl.int64)
        offs_n = nb * BN + tl.arange(0, BN)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, H, BK, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + tok[:, None] * H + offs_k[None, :], mask=rmask[:, None], other=0.0)
            w_off = offs_k[:, None] * I + offs_n[None, :]
            acc_g = tl.dot(a, tl.load(wg_base + w_off), acc_g)
            acc_u = tl.dot(a, tl.load(wu_base + w_off), acc_u)
        act = acc_g * tl.sigmoid(acc_g)
        up = acc_u
        if HAS_LIMIT:
            act = tl.minimum(act, act_limit)
            up = tl.minimum(tl.maximum(up, -act_limit), act_limit)
        tl.store(act_ptr + r.to(tl.int64)[:, None] * I + offs_n[None, :], (act * up).to(tl.float16),
                 mask=rmask[:, None])

    @triton.jit
    def down_item(act_ptr, tok_ptr, wt_ptr, wd_base, out_ptr, start, cnt, mb, nb,
                  H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  STAGES: tl.constexpr):
        rows = mb * BM + tl.arange(0, BM)
        rmask = rows < cnt
        r = (start + rows).to(tl.int64)
        offs_n = nb * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, I, BK, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BK)
            a = tl.load(act_ptr + r[:, None] * I + offs_k[None, :], mask=rmask[:, None], other=0.0)
            acc = tl.dot(a, tl.load(wd_base + offs_k[:, None] * H + offs_n[None, :]), acc)
        tok = tl.load(tok_ptr + r, mask=rmask, other=0).to(tl.int64)
        wt = tl.load(wt_ptr + r, mask=rmask, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
        tl.atomic_add(out_ptr + tok[:, None] * H + offs_n[None, :], acc, mask=rmask[:, None], sem="relaxed")

    @triton.jit
    def gate_up(x_ptr, tok_ptr, ids_ptr, starts_ptr, counts_ptr, wg_ptr, wu_ptr, act_ptr, n_tile, act_limit,
                H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                HAS_LIMIT: tl.constexpr, STAGES: tl.constexpr, PERSISTENT: tl.constexpr):
        NB: tl.constexpr = I // BN
        if PERSISTENT:
            pid = tl.program_id(0)
            nprog = tl.num_programs(0)
            base = 0
            for b in range(n_tile):
                e = tl.load(ids_ptr + b)
                start = tl.load(starts_ptr + e).to(tl.int32)
                cnt = tl.load(counts_ptr + e).to(tl.int32)
                items = tl.cdiv(cnt, BM) * NB
                first = (pid + nprog - base % nprog) % nprog
                for it in range(first, items, nprog):
                    gate_up_item(x_ptr, tok_ptr, wg_ptr + b.to(tl.int64) * (H * I), wu_ptr + b.to(tl.int64) * (H * I),
                                 act_ptr, start, cnt, it // NB, it % NB, act_limit, H, I, BM, BN, BK, HAS_LIMIT, STAGES)
                base += items
        else:
            b = tl.program_id(0)
            mb = tl.program_id(1)
            nb = tl.program_id(2)
            e = tl.load(ids_ptr + b)
            start = tl.load(starts_ptr + e).to(tl.int32)
            cnt = tl.load(counts_ptr + e).to(tl.int32)
            if mb * BM < cnt:
                gate_up_item(x_ptr, tok_ptr, wg_ptr + b.to(tl.int64) * (H * I), wu_ptr + b.to(tl.int64) * (H * I),
                             act_ptr, start, cnt, mb, nb, act_limit, H, I, BM, BN, BK, HAS_LIMIT, STAGES)

    @triton.jit
    def down(act_ptr, tok_ptr, wt_ptr, ids_ptr, starts_ptr, counts_ptr, wd_ptr, out_ptr, n_tile,
             H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             STAGES: tl.constexpr, PERSISTENT: tl.constexpr):
        NB: tl.constexpr = H // BN
        if PERSISTENT:
            pid = tl.program_id(0)
            nprog = tl.num_programs(0)
            base = 0
            for b in range(n_tile):
                e = tl.load(ids_ptr + b)
                start = tl.load(starts_ptr + e).to(tl.int32)
                cnt = tl.load(counts_ptr + e).to(tl.int32)
                items = tl.cdiv(cnt, BM) * NB
                first = (pid + nprog - base % nprog) % nprog
                for it in range(first, items, nprog):
                    down_item(act_ptr, tok_ptr, wt_ptr, wd_ptr + b.to(tl.int64) * (H * I), out_ptr, start, cnt,
                              it // NB, it % NB, H, I, BM, BN, BK, STAGES)
                base += items
        else:
            b = tl.program_id(0)
            mb = tl.program_id(1)
            nb = tl.program_id(2)
            e = tl.load(ids_ptr + b)
            start = tl.load(starts_ptr + e).to(tl.int32)
            cnt = tl.load(counts_ptr + e).to(tl.int32)
            if mb * BM < cnt:
                down_item(act_ptr, tok_ptr, wt_ptr, wd_ptr + b.to(tl.int64) * (H * I), out_ptr, start, cnt, mb, nb,
                          H, I, BM, BN, BK, STAGES)

    return gate_up, down


@lru_cache(maxsize=1)
def rotated_kernels() -> Any:  # Triton JIT kernels: CUDA only
    import triton
    import triton.language as tl

    @triton.jit
    def hadamard16(v, had):
        """v [rows, 128] rounded to fp16 (where exllamav3 rounds it), times the +-1 Hadamard, fp32, unscaled."""
        return tl.dot(v.to(tl.float16), had)

    @triton.jit
    def hadamard32(acc, had):
        """acc [rows, 128] fp32 times the +-1 Hadamard, unscaled, as hi and lo fp16 halves: exact to ~2^-22 (the
        +-1 entries multiply exactly), for down's output, which exllamav3 keeps in fp32."""
        hi = acc.to(tl.float16)
        lo = (acc - hi.to(tl.float32)).to(tl.float16)
        return tl.dot(lo, had, tl.dot(hi, had))

    @triton.jit
    def load_had(had_ptr):
        idx = tl.arange(0, 128)
        return tl.load(had_ptr + idx[:, None] * 128 + idx[None, :])

    @triton.jit
    def rotate_in(x_ptr, tok_ptr, exp_ptr, sel_ptr, suh_g_ptr, suh_u_ptr, had_ptr, xg_ptr, xu_ptr, n_rows, scale,
                  H: tl.constexpr, BR: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        inside = r < n_rows
        e = tl.load(exp_ptr + r, mask=inside, other=0)
        # Rows of experts outside this call's set (other ranks' experts: bin E; the plan's light experts) stay unset.
        live = inside & (tl.load(sel_ptr + e, mask=inside, other=0) != 0)
        tok = tl.load(tok_ptr + r, mask=live, other=0).to(tl.int64)
        had = load_had(had_ptr)
        for kb in tl.static_range(0, H // 128):
            cols = kb * 128 + tl.arange(0, 128)
            x = tl.load(x_ptr + tok[:, None] * H + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            srow = e.to(tl.int64)[:, None] * H + cols[None, :]
            dst = r.to(tl.int64)[:, None] * H + cols[None, :]
            sg = tl.load(suh_g_ptr + srow, mask=live[:, None], other=0.0).to(tl.float32)
            tl.store(xg_ptr + dst, (hadamard16(x * sg, had) * scale).to(tl.float16), mask=live[:, None])
            su = tl.load(suh_u_ptr + srow, mask=live[:, None], other=0.0).to(tl.float32)
            tl.store(xu_ptr + dst, (hadamard16(x * su, had) * scale).to(tl.float16), mask=live[:, None])

    @triton.jit
    def gate_up_rot(xg_ptr, xu_ptr, ids_ptr, starts_ptr, counts_ptr, wg_ptr, wu_ptr, svh_g_ptr, svh_u_ptr, suh_d_ptr,
                    had_ptr, act_ptr, act_limit, scale, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr, HAS_LIMIT: tl.constexpr, STAGES: tl.constexpr):
        # Column block fastest: the programs sharing a row block's inputs run together and find them in L2.
        b = tl.program_id(2)
        e = tl.load(ids_ptr + b)
        start = tl.load(starts_ptr + e)
        cnt = tl.load(counts_ptr + e)
        # Output columns: one Hadamard block.
        offs_n = tl.program_id(0) * 128 + tl.arange(0, 128)
        wg_base = wg_ptr + b.to(tl.int64) * (H * I)
        wu_base = wu_ptr + b.to(tl.int64) * (H * I)
        vrow = e.to(tl.int64) * I + offs_n
        # Row blocks strided over the grid's row programs (fewer than T / BM when capped: see ROW_PROGRAMS).
        for mb in range(tl.program_id(1), tl.cdiv(cnt, BM), tl.num_programs(1)):
            rows = mb * BM + tl.arange(0, BM)
            rmask = rows < cnt
            r = (start + rows).to(tl.int64)
            acc_g = tl.zeros((BM, 128), dtype=tl.float32)
            acc_u = tl.zeros((BM, 128), dtype=tl.float32)
            for k0 in tl.range(0, H, BK, num_stages=STAGES):
                offs_k = k0 + tl.arange(0, BK)
                a_off = r[:, None] * H + offs_k[None, :]
                w_off = offs_k[:, None] * I + offs_n[None, :]
                acc_g = tl.dot(tl.load(xg_ptr + a_off, mask=rmask[:, None], other=0.0), tl.load(wg_base + w_off), acc_g)
                acc_u = tl.dot(tl.load(xu_ptr + a_off, mask=rmask[:, None], other=0.0), tl.load(wu_base + w_off), acc_u)
            had = load_had(had_ptr)
            gate = hadamard16(acc_g, had) * (tl.load(svh_g_ptr + vrow).to(tl.float32) * scale)[None, :]
            up = hadamard16(acc_u, had) * (tl.load(svh_u_ptr + vrow).to(tl.float32) * scale)[None, :]
            act = gate * tl.sigmoid(gate)
            if HAS_LIMIT:
                act = tl.minimum(act, act_limit)
                up = tl.minimum(tl.maximum(up, -act_limit), act_limit)
            act = act * up * tl.load(suh_d_ptr + vrow).to(tl.float32)[None, :]
            tl.store(act_ptr + r[:, None] * I + offs_n[None, :], (hadamard16(act, had) * scale).to(tl.float16),
                     mask=rmask[:, None])

    @triton.jit
    def down_rot(act_ptr, tok_ptr, wt_ptr, ids_ptr, starts_ptr, counts_ptr, wd_ptr, svh_d_ptr, had_ptr, out_ptr, scale,
                 H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
        b = tl.program_id(2)
        e = tl.load(ids_ptr + b)
        start = tl.load(starts_ptr + e)
        cnt = tl.load(counts_ptr + e)
        offs_n = tl.program_id(0) * 128 + tl.arange(0, 128)
        wd_base = wd_ptr + b.to(tl.int64) * (H * I)
        svh = tl.load(svh_d_ptr + e.to(tl.int64) * H + offs_n).to(tl.float32) * scale
        for mb in range(tl.program_id(1), tl.cdiv(cnt, BM), tl.num_programs(1)):
            rows = mb * BM + tl.arange(0, BM)
            rmask = rows < cnt
            r = (start + rows).to(tl.int64)
            acc = tl.zeros((BM, 128), dtype=tl.float32)
            for k0 in tl.range(0, I, BK, num_stages=STAGES):
                offs_k = k0 + tl.arange(0, BK)
                a = tl.load(act_ptr + r[:, None] * I + offs_k[None, :], mask=rmask[:, None], other=0.0)
                acc = tl.dot(a, tl.load(wd_base + offs_k[:, None] * H + offs_n[None, :]), acc)
            had = load_had(had_ptr)
            tok = tl.load(tok_ptr + r, mask=rmask, other=0).to(tl.int64)
            wt = tl.load(wt_ptr + r, mask=rmask, other=0.0).to(tl.float32)
            y = hadamard32(acc, had) * svh[None, :] * wt[:, None]
            tl.atomic_add(out_ptr + tok[:, None] * H + offs_n[None, :], y, mask=rmask[:, None], sem="relaxed")

    return rotate_in, gate_up_rot, down_rot


@lru_cache(maxsize=None)
def hadamard_pm1(device: torch.device) -> torch.Tensor:
    """The 128-point Sylvester Hadamard with +-1 entries, fp16 (exact), for the kernels' epilogue products."""
    return (hadamard_128() * HADAMARD_BLOCK**0.5).round().to(device=device, dtype=torch.float16).contiguous()


def rotate_inputs(x16: torch.Tensor, tok_sorted: torch.Tensor, exp_sorted: torch.Tensor, selected: torch.Tensor,
                  suh_g: torch.Tensor, suh_u: torch.Tensor, xg: torch.Tensor, xu: torch.Tensor) -> None:
    """xg[r] = had(x[tok[r]] * suh_g[e_r]), xu likewise, for each sorted row r whose expert e_r is selected
    (selected: int32 [E+1], bin E never)."""
    rotate_in = rotated_kernels()[0]
    rows, hidden = tok_sorted.shape[0], x16.shape[1]
    grid = (triton_cdiv(rows, ROTATE_ROWS),)
    rotate_in[grid](x16, tok_sorted, exp_sorted, selected, suh_g, suh_u, hadamard_pm1(x16.device), xg, xu, rows,
                    HADAMARD_SCALE, H=hidden, BR=ROTATE_ROWS, num_warps=4)


def row_programs(tokens: int, block_rows: int) -> int:
    """Programs per (expert, column block) along the rows: one per possible row block (T rows), at most
    ROW_PROGRAMS (0: no cap), each looping over its strided share of the expert's row blocks."""
    blocks = triton_cdiv(tokens, block_rows)
    return min(blocks, ROW_PROGRAMS) if ROW_PROGRAMS else blocks


def tile_mlp_rotated(xg: torch.Tensor, xu: torch.Tensor, tok_sorted: torch.Tensor, w_sorted: torch.Tensor,
                     ids: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor,
                     w_up: torch.Tensor, w_down: torch.Tensor, scales: tuple[torch.Tensor, ...], act: torch.Tensor,
                     out: torch.Tensor, act_limit: float, tokens: int) -> None:
    """`tile_mlp` over rotated-basis weights W_hat and rotated inputs (`rotate_inputs`); scales: the layer's stacked
    (svh_g, svh_u, suh_d, svh_d), indexed by expert id; tokens: T, the most rows an expert can have."""
    _rotate_in, gate_up_rot, down_rot = rotated_kernels()
    svh_g, svh_u, suh_d, svh_d = scales
    hidden, inter = w_gate.shape[1], w_gate.shape[2]
    n_tile, had = ids.shape[0], hadamard_pm1(xg.device)
    bm, bk, warps, stages = ROT_GATE_UP_BLOCK
    grid = (inter // HADAMARD_BLOCK, row_programs(tokens, bm), n_tile)
    gate_up_rot[grid](xg, xu, ids, starts, counts, w_gate, w_up, svh_g, svh_u, suh_d, had, act, float(act_limit),
                      HADAMARD_SCALE, H=hidden, I=inter, BM=bm, BK=bk, HAS_LIMIT=act_limit > 0, STAGES=stages,
                      num_warps=warps)
    bm, bk, warps, stages = ROT_DOWN_BLOCK
    grid = (hidden // HADAMARD_BLOCK, row_programs(tokens, bm), n_tile)
    down_rot[grid](act, tok_sorted, w_sorted, ids, starts, counts, w_down, svh_d, had, out, HADAMARD_SCALE,
                   H=hidden, I=inter, BM=bm, BK=bk, STAGES=stages, num_warps=warps)


@lru_cache(maxsize=None)
def programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count * PROGRAMS_PER_SM


def tile_mlp(x16: torch.Tensor, tok_sorted: torch.Tensor, w_sorted: torch.Tensor, ids: torch.Tensor,
             starts: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
             w_down: torch.Tensor, act: torch.Tensor, out: torch.Tensor, act_limit: float) -> None:
    """out[tok] += w * down(act(gate(x[tok]), up(x[tok]))) for the rows of the tile's experts `ids`."""
    gate_up, down = kernels()
    hidden, inter = w_gate.shape[1], w_gate.shape[2]
    n_tile = ids.shape[0]
    tokens = x16.shape[0]
    bm, bn, bk, warps, stages = GATE_UP_BLOCK
    # One program per (expert, row block, column block) up to an expert's most rows (T: a token picks an expert
    # once); blocks past an expert's rows return at once. PERSISTENT: a fixed grid walks the items instead.
    grid = (programs(x16.device.index or 0),) if PERSISTENT else (n_tile, triton_cdiv(tokens, bm), inter // bn)
    gate_up[grid](x16, tok_sorted, ids, starts, counts, w_gate, w_up, act, n_tile, float(act_limit),
                  H=hidden, I=inter, BM=bm, BN=bn, BK=bk, HAS_LIMIT=act_limit > 0, STAGES=stages,
                  PERSISTENT=PERSISTENT, num_warps=warps)
    bm, bn, bk, warps, stages = DOWN_BLOCK
    grid = (programs(x16.device.index or 0),) if PERSISTENT else (n_tile, triton_cdiv(tokens, bm), hidden // bn)
    down[grid](act, tok_sorted, w_sorted, ids, starts, counts, w_down, out, n_tile,
               H=hidden, I=inter, BM=bm, BN=bn, BK=bk, STAGES=stages, PERSISTENT=PERSISTENT, num_warps=warps)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_mlp_reference(x16, tok_sorted, w_sorted, ids, starts, counts, w_gate, w_up, w_down, act, out,
                       act_limit: float) -> None:
    """`tile_mlp` in torch, one expert at a time (reads the counts back): the CPU twin the tests compare with."""
    del act
    for b, e in enumerate(ids.tolist()):
        start, cnt = int(starts[e]), int(counts[e])
        if cnt == 0:
            continue
        tok = tok_sorted[start : start + cnt]
        xs = x16.index_select(0, tok).float()
        g = xs @ w_gate[b].float()
        u = xs @ w_up[b].float()
        a = torch.nn.functional.silu(g)
        if act_limit > 0:
            a = a.clamp(max=act_limit)
            u = u.clamp(-act_limit, act_limit)
        y = (a * u).half().float() @ w_down[b].float()
        out.index_add_(0, tok, y * w_sorted[start : start + cnt].float().unsqueeze(1))


def rotate_inputs_reference(x16: torch.Tensor, tok_sorted: torch.Tensor, exp_sorted: torch.Tensor,
                            selected: torch.Tensor, suh_g: torch.Tensor, suh_u: torch.Tensor, xg: torch.Tensor,
                            xu: torch.Tensor) -> None:
    """`rotate_inputs` in torch (hadamard.rotate_cols, fp32, the kernel's fp16 rounding points): the CPU twin."""
    rows = (selected[exp_sorted] != 0).nonzero().flatten()
    x = x16.index_select(0, tok_sorted[rows]).float()
    e = exp_sorted[rows]
    xg[rows] = rotate_cols((x * suh_g[e].float()).half().float()).half()
    xu[rows] = rotate_cols((x * suh_u[e].float()).half().float()).half()


def tile_mlp_rotated_reference(xg, xu, tok_sorted, w_sorted, ids, starts, counts, w_gate, w_up, w_down,
                               scales: tuple[torch.Tensor, ...], act, out, act_limit: float, tokens: int) -> None:
    """`tile_mlp_rotated` in torch, one expert at a time (reads the counts back), with the kernels' fp16 rounding
    points: the CPU twin."""
    del act, tokens
    svh_g, svh_u, suh_d, svh_d = scales
    for b, e in enumerate(ids.tolist()):
        start, cnt = int(starts[e]), int(counts[e])
        if cnt == 0:
            continue
        rows = slice(start, start + cnt)
        g = rotate_cols((xg[rows].float() @ w_gate[b].float()).half().float()) * svh_g[e].float()
        u = rotate_cols((xu[rows].float() @ w_up[b].float()).half().float()) * svh_u[e].float()
        a = torch.nn.functional.silu(g)
        if act_limit > 0:
            a = a.clamp(max=act_limit)
            u = u.clamp(-act_limit, act_limit)
        h = rotate_cols((a * u * suh_d[e].float()).half().float()).half().float()
        y = rotate_cols(h @ w_down[b].float()) * svh_d[e].float()
        out.index_add_(0, tok_sorted[rows], y * w_sorted[rows].float().unsqueeze(1))
