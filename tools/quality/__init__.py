"""Quality-gate tools: make the reference set the gate checks a served model against (docs/quality-gate.md).

Run from the repository root:

    python -m tools.quality.make_reference MODEL_DIR OUTDIR [--prompts FILE] [--top-k 20]
    python -m tools.quality.make_reference MODEL_DIR OUTDIR --hidden-states DIR --head FILE   # hidden_teacher.py
"""
