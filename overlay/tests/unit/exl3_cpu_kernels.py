"""CPU stand-ins for the kernel entry points `runtime.Exl3CudaExperts` calls: exllamav3's `exl3_moe_coop`,
`exl3_moe`, `exl3_moe_max_concurrency`, `exl3_gemm`, `silu_mul`, `reconstruct_had_batch`, `reconstruct_batch`, and ours,
`mcg4_moe`. Same signatures and
argument order as the extensions (exllamav3 1.6.5's exl3_moe.cuh / exl3_gemm.cuh / exl3_moe_coop.cuh, our
csrc/mcg4_moe.cu); the arithmetic is the exact reference decoder (`reference.dequantize`) in fp32. Tests only.

Like the CUDA kernels, the exllamav3 stand-ins find each expert's trellis / suh / svh through the int64
pointer tables, reading host memory at those addresses, so a wrong table (order, stride, a slice that is
not contiguous, a tensor freed too early) gives wrong output here as it would on a GPU. They also check
the preconditions the kernels rely on: fp16 activations, scratch large enough for the call.
"""

from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import torch

from glm53_overlay.exl3.reference import dequantize, reconstruct_rotated
from glm53_overlay.exl3.runtime import coop_counter_len
from glm53_overlay.exl3.trellis import TILE

# What exl3_moe_max_concurrency reports: the fused kernel's scratch holds this many expert groups.
CONCURRENCY = 2


def _tensor_at(address: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A copy of the tensor of this shape stored at a host address (what a kernel reads through a pointer)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    buffer = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(bytearray(buffer), dtype=dtype).view(shape)


def _codebook(mcg: bool, mul1: bool) -> str:
    return "mcg" if mcg else "mul1" if mul1 else "3inst"


# Decoded weights by content (codebook and the bytes of trellis, suh, svh): the stand-ins decode each expert
# once per test session instead of once per call. Keyed by content, never by address, so a freed and reused
# address cannot return another tensor's weights.
_DECODED: dict[tuple[str, bytes, bytes, bytes], torch.Tensor] = {}


def _decoded(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str) -> torch.Tensor:
    """fp32 copy of the exact fp16 W [k, n] (reference.dequantize)."""
    key = (codebook, *(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (trellis, suh, svh)))
    if key not in _DECODED:
        _DECODED[key] = dequantize(trellis, suh, svh, codebook=codebook).float()  # type: ignore[arg-type]
    return _DECODED[key]


def _weights(ptrs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], expert: int, k: int, n: int, bits: float,
             codebook: str) -> torch.Tensor:
    """Expert `expert`'s W [k, n] through its pointer-table entries."""
    trellis_ptr, suh_ptr, svh_ptr = (int(table[expert]) for table in ptrs)
    trellis = _tensor_at(trellis_ptr, (k // TILE, n // TILE, int(TILE * bits)), torch.int16)
    suh = _tensor_at(suh_ptr, (k,), torch.float16)
    svh = _tensor_at(svh_ptr, (n,), torch.float16)
    return _decoded(trellis, suh, svh, codebook)


def _act(g: torch.Tensor, u: torch.Tensor, act_limit: float) -> torch.Tensor:
    a = torch.nn.functional.silu(g)
    if act_limit:
        a = a.clamp(max=act_limit)
        u = u.clamp(-act_limit, act_limit)
    return a * u


class _Experts:
    """One call's view of the three projections through their pointer tables (weights decoded on first use)."""

    def __init__(self, hidden: int, inter: int, bits: tuple[float, float, float], codebook: str, tables) -> None:
        self.shapes = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
        self.bits = dict(zip(("gate", "up", "down"), bits))
        self.codebook, self.tables, self.cache = codebook, tables, {}

    def weight(self, name: str, expert: int) -> torch.Tensor:
        if (name, expert) not in self.cache:
            k, n = self.shapes[name]
            self.cache[(name, expert)] = _weights(self.tables[name], expert, k, n, self.bits[name], self.codebook)
        return self.cache[(name, expert)]

    def forward(self, expert: int, x16: torch.Tensor, act_limit: float) -> torch.Tensor:
        """fp32 [m, hidden]: the activation is rounded to fp16 between up/gate and down, as the kernels do."""
        x = x16.float()
        h = _act(x @ self.weight("gate", expert), x @ self.weight("up", expert), act_limit).half()
        return h.float() @ self.weight("down", expert)


def exl3_moe_coop(x, sel, rw, min_expert, max_expert, Hi, g_trellis, g_suh, g_svh, u_trellis, u_suh, u_svh,
                  d_trellis, d_suh, d_svh, g_bias, u_bias, d_bias, Kg, Ku, Kd, mcg, mul1, act, act_limit, gated,
                  had_g, had_u, gu_g, gu_u, act_out, d_out, ctr, out, sh_out, sh_gate_w) -> None:
    bsz, topk = sel.shape
    inter, hidden_out = gu_g.shape[1], d_out.shape[1]
    assert x.dtype == torch.float16 and sel.dtype == torch.int64 and rw.dtype == torch.float16
    assert (min_expert, max_expert, act, gated) == (-1, -1, 0, True) and g_bias is u_bias is d_bias is sh_out is None
    assert bsz * topk <= gu_g.shape[0] and bsz <= out.shape[0] and x.shape[1] == Hi
    assert ctr.numel() >= coop_counter_len(gu_g.shape[0], out.shape[0], inter, hidden_out), "coop counters too short"
    experts = _Experts(Hi, inter, (Kg, Ku, Kd), _codebook(mcg, mul1), {
        "gate": (g_trellis, g_suh, g_svh), "up": (u_trellis, u_suh, u_svh), "down": (d_trellis, d_suh, d_svh)})
    for t in range(bsz):
        out[t] = sum(rw[t, j].float() * experts.forward(int(sel[t, j]), x[t : t + 1], act_limit)[0] for j in range(topk))


def exl3_moe(hidden_state, output_state, expert_count, token_sorted, weight_sorted, temp_state_g, temp_state_u,
             temp_intermediate_g, temp_intermediate_u, act_function, K_gate, K_up, K_down,
             gate_ptrs_trellis, gate_ptrs_suh, gate_ptrs_svh, up_ptrs_trellis, up_ptrs_suh, up_ptrs_svh,
             down_ptrs_trellis, down_ptrs_suh, down_ptrs_svh, gate_mcg, gate_mul1, up_mcg, up_mul1, down_mcg,
             down_mul1, act_limit, num_active, output_scratch, fused_base, count_lo, count_hi, m_tile) -> None:
    """Adds sum_j w * expert(x) into output_state for every expert whose row count is in [count_lo, count_hi]
    (heavier experts are the caller's); rows beyond the last expert (ids not on this rank) are skipped."""
    assert hidden_state.dtype == torch.float16 and output_state.dtype == torch.float32 and act_function == 0
    assert count_hi <= temp_state_g.shape[1], "fused scratch holds fewer rows than count_hi"
    hidden, inter = hidden_state.shape[1], temp_intermediate_g.shape[-1]
    codebook = _codebook(gate_mcg, gate_mul1)
    assert codebook == _codebook(up_mcg, up_mul1) == _codebook(down_mcg, down_mul1)
    experts = _Experts(hidden, inter, (K_gate, K_up, K_down), codebook, {
        "gate": (gate_ptrs_trellis, gate_ptrs_suh, gate_ptrs_svh), "up": (up_ptrs_trellis, up_ptrs_suh, up_ptrs_svh),
        "down": (down_ptrs_trellis, down_ptrs_suh, down_ptrs_svh)})
    counts = expert_count.tolist()
    start = 0
    for expert, count in enumerate(counts[:-1]):
        if count_lo <= count <= count_hi and count:
            rows = token_sorted[start : start + count]
            y = experts.forward(expert, hidden_state.index_select(0, rows), act_limit)
            output_state.index_add_(0, rows, y * weight_sorted[start : start + count].float().unsqueeze(1))
        start += count


def exl3_moe_max_concurrency(device: int) -> int:
    return CONCURRENCY


def exl3_gemm(A, B, C, suh, A_had, svh, force_shape_idx, mcg, mul1, force_num_sms) -> int:
    assert A.dtype == torch.float16 and A_had.shape == A.shape
    C.copy_((A.float() @ _decoded(B, suh, svh, _codebook(mcg, mul1))).to(C.dtype))
    return 0


def reconstruct_had_batch(unpacked, packed_ptrs, suh_ptrs, svh_ptrs, K, mcg, mul1) -> None:
    assert unpacked.dtype == torch.float16 and unpacked.is_contiguous() and unpacked.dim() == 3
    batch, k, n = unpacked.shape
    for index in range(batch):
        unpacked[index] = _weights((packed_ptrs, suh_ptrs, svh_ptrs), index, k, n, K, _codebook(mcg, mul1)).half()


def reconstruct_batch(unpacked, packed_ptrs, K, mcg, mul1) -> None:
    """W_hat (the rotated basis, no suh/svh and no Hadamard) of each trellis in the pointer table."""
    assert unpacked.dtype == torch.float16 and unpacked.is_contiguous() and unpacked.dim() == 3
    batch, k, n = unpacked.shape
    for index in range(batch):
        trellis = _tensor_at(int(packed_ptrs[index]), (k // TILE, n // TILE, int(TILE * K)), torch.int16)
        unpacked[index] = reconstruct_rotated(trellis, codebook=_codebook(mcg, mul1))


def silu_mul(x, y, z, act_limit) -> None:
    z.copy_(_act(x.float(), y.float(), act_limit).to(z.dtype))


def mcg4_moe(x, ids, weights, trellis_g, suh_g, svh_g, trellis_u, suh_u, svh_u, trellis_d, suh_d, svh_d,
             gu, y, out, consts, act_limit, gate_up_warps, down_warps, pdl, stream) -> None:
    """Our decode kernels' contract: out[t] = sum_j w[t, j] * expert(ids[t, j])(x[t]) in x's dtype."""
    tokens, top_k = ids.shape
    assert gu.shape[1] == y.shape[0] == tokens * top_k and weights.dtype == torch.float32
    stacked = {"gate": (trellis_g, suh_g, svh_g), "up": (trellis_u, suh_u, svh_u), "down": (trellis_d, suh_d, svh_d)}
    # Our kernels take the stacked tensors, not pointer tables: index them directly.
    cache: dict[tuple[str, int], torch.Tensor] = {}

    def weight(name: str, expert: int) -> torch.Tensor:
        if (name, expert) not in cache:
            t, s, v = (part[expert] for part in stacked[name])
            cache[(name, expert)] = _decoded(t, s, v, "mcg")
        return cache[(name, expert)]

    for t in range(tokens):
        row = x[t : t + 1].half().float()  # our kernels round the rotated input to fp16, as exllamav3 does
        acc = torch.zeros(x.shape[1])
        for j in range(top_k):
            e = int(ids[t, j])
            h = _act(row @ weight("gate", e), row @ weight("up", e), act_limit).half().float()
            acc += weights[t, j] * (h @ weight("down", e))[0]
        out[t] = acc.to(out.dtype)


# What `runtime.load_kernels()` and `mcg4_moe.load_extension()` return, for monkeypatching them.
EXLLAMAV3 = SimpleNamespace(__name__="exl3_cpu_kernels (CPU stand-ins)", exl3_moe_coop=exl3_moe_coop, exl3_moe=exl3_moe,
                            exl3_moe_max_concurrency=exl3_moe_max_concurrency, exl3_gemm=exl3_gemm, silu_mul=silu_mul,
                            reconstruct_had_batch=reconstruct_had_batch, reconstruct_batch=reconstruct_batch)
MCG4 = SimpleNamespace(__name__="mcg4 (CPU stand-in)", mcg4_moe=mcg4_moe)
