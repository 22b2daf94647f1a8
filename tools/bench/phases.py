"""The prompts the benchmark sends: the recipe's two phases, a code phase, and the coherence probes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    prompt: str
    # A short request with the same prompt before measuring: it fills the prefix cache and any lazily
    # compiled shapes, so the first measured request is not the one that pays for them.
    warmup_tokens: int | None = None


PHASES: dict[str, Phase] = {p.name: p for p in (
    # Highly predictable text: the best case for a draft model, the recipe's headline number.
    Phase("structured", "Count from 1 to 200, separated by commas.", warmup_tokens=32),
    # Free text: the draft guesses worse, the number users feel in chat.
    Phase("prose", "Explain how a hash map works: hashing, buckets, collisions, resizing, and the cost "
                   "of each operation."),
    Phase("code", "Write a Python function that parses an ISO 8601 date string without using datetime, "
                  "with type hints, a docstring and a few doctests."),
)}

# Not a prompt of its own: decode streams plus a cold long prompt (mixed.py).
MIXED = "mixed"

# Short questions whose answers a healthy engine always gets as readable text; a broken kernel or a
# wrong quantization shows up as empty output or as garbage bytes long before it shows in tok/s.
COHERENCE_PROBES: tuple[str, ...] = (
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
)
COHERENCE_MAX_TOKENS = 48


def check_answer(text: str, min_printable: float = 0.9) -> tuple[bool, str]:
    """Non-empty, mostly printable, and not one character over and over.

    The repeated-character rule is there because degenerate engines (bad weights, bad attention
    backend) typically stream a single token such as ``!!!!!!!`` while /health stays green.
    """
    stripped = text.strip()
    if not stripped:
        return False, "empty answer"
    # U+FFFD counts as garbage: it is what a detokenizer emits for bytes that are not UTF-8.
    printable = sum(1 for c in stripped if (c.isprintable() or c.isspace()) and c != "\ufffd") / len(stripped)
    if printable < min_printable:
        return False, f"only {printable:.0%} printable characters"
    if len(stripped) > 3 and len(set(stripped)) == 1:
        return False, f"one character repeated: {stripped[:12]!r}"
    return True, "ok"
