"""Each SM12x fix was written against vLLM 0.33.0's text (read from the pinned sdist) and refuses other text."""

from __future__ import annotations

import hashlib
import textwrap

import pytest

from tools import vllm_sdist
from glm53_overlay import sm12x
from glm53_overlay.sm12x import indexer_topk, kpool_tail_slots, kpool_topk_width, pdl_gate
from glm53_overlay.sm12x.source_guard import require_source, signature_text, source_sha256

# (fix, its table, file in the sdist, class or None, function)
GUARDED = [
    (pdl_gate, pdl_gate.SOURCE_SHA256, "vllm/platforms/cuda.py", "CudaPlatformBase", "is_arch_support_pdl"),
    (indexer_topk, indexer_topk.SOURCE_SHA256, "vllm/model_executor/layers/indexer_topk.py", "SparseIndexerTopk",
     "_resolve_auto"),
    (kpool_topk_width, kpool_topk_width.SOURCE_SHA256, "vllm/models/glm5next/common/model.py", None,
     "get_sparse_topk_buffer_width"),
    (kpool_tail_slots, kpool_tail_slots.SOURCE_SHA256, "vllm/v1/attention/backends/mla/indexer.py", None,
     "compute_kpool_tail_slot_mapping"),
    (kpool_tail_slots, kpool_tail_slots.KERNEL_SHA256, "vllm/v1/attention/backends/mla/indexer.py", None,
     "_kpool_tail_slot_mapping_kernel"),
]


@pytest.mark.parametrize("fix, table, member, owner, function", GUARDED, ids=lambda v: getattr(v, "NAME", None))
def test_each_fix_accepts_vllm_0_3_3s_text(vllm_033_source, fix, table, member, owner, function):
    text = textwrap.dedent(vllm_sdist.function_text(member, function, owner))
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert [release for release, known in table.items() if known == digest and "0.33.0" in release]


def test_every_fix_in_the_package_is_guarded_or_checks_an_attribute():
    # dense_mha_prefill sets a class attribute and reads it back; every other fix replaces or relies on code.
    guarded = {entry[0].NAME for entry in GUARDED}
    assert guarded | {"sm120-no-dense-mha-prefill"} == set(sm12x.fix_names())


def test_the_guard_names_what_differs():
    def f(a: int) -> int:
        return a

    digest = source_sha256(f)
    assert require_source(f, "(a: int) -> int", {"here": digest}) == "here"
    assert signature_text(f, annotations=False) == "(a)"
    with pytest.raises(LookupError, match=r"has signature \(a: int\) -> int, the fix was written for \(b\)"):
        require_source(f, "(b)", {"here": digest})
    with pytest.raises(LookupError, match="source text changed"):
        require_source(f, "(a: int) -> int", {"vllm 0.33.0": "0" * 64})
