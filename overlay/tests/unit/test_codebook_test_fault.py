"""The quality gate's test-only fault hook in codebook.py: off unless its variable is set, and then wrong."""
from __future__ import annotations

import pytest
import torch

from glm53_overlay.exl3 import codebook


def test_the_mcg_decode_is_exact_without_the_variable_and_wrong_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    states = torch.arange(1 << 16)
    monkeypatch.delenv(codebook.TEST_FAULT_ENV, raising=False)
    exact = codebook.decode_states(states, "mcg")
    monkeypatch.setenv(codebook.TEST_FAULT_ENV, "")
    assert torch.equal(codebook.decode_states(states, "mcg").view(torch.int16), exact.view(torch.int16))
    monkeypatch.setenv(codebook.TEST_FAULT_ENV, "0x10")
    wrong = codebook.decode_states(states, "mcg")
    assert (wrong != exact).float().mean() > 0.5
    # Same distribution of values (the engine still serves fluently), different weights.
    assert wrong.float().std().item() == pytest.approx(exact.float().std().item(), rel=0.1)
