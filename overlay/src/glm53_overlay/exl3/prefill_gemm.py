"""Triton grouped GEMMs for our prefill MoE path (`prefill_moe.py`): the rows of each expert of a tile, found on
the device, against that expert's decoded fp16 weights. Two kernels per tile, no host sync, graph safe.

- `gate_up`: for the rows of each expert b of the tile, gate = x @ Wg[b] and up = x @ Wu[b] in one main loop (the
  input rows gathered by token id in the loads), then act = SiLU(gate) * up with exllamav3's clamp
  (`act_limit`: SiLU from above, up symmetrically), stored fp16 at the rows' sorted positions.
- `down`: y = act @ Wd[b], times the row's routing weight, added into the fp32 output row of its token
  (atomic adds: a token's k experts arrive in any order, as exl3_moe's do).

Which rows belong to which expert is read on the device (`counts`, `starts` over the expert-sorted
assignments), so the launch shape is fixed: a persistent grid walks the tile's (expert, row block, column
block) items round-robin. Imports Triton on first use only (plugin import stays cheap).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

# (rows, columns, k) per block, warps, pipeline stages; measured on the H200 (benchmarks/results/prefill/).
GATE_UP_BLOCK = (64, 64, 64, 4, 3)
DOWN_BLOCK = (64, 64, 64, 4, 3)
# Persistent grid (programs walk the items) or one program per possible item; persistent programs per SM.
PERSISTENT = False
PROGRAMS_PER_SM = 2


@lru_cache(maxsize=1)
def kernels() -> Any:
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
