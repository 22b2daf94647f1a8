"""Simulation assets: tiny checkpoints in GLM-5.3 Flash's format made locally and a local Hugging Face endpoint.

Run from the repository root:

    python -m tools.sim_model.make_tiny_glm OUTDIR [--seed N] [--twin TWIN_DIR | --bf16]
    python -m tools.sim_model.make_tiny_dflash TARGET_DIR OUTDIR [--seed N]
    python -m tools.sim_model.serve_hub MODELS_DIR --workdir DIR [--port P]
"""
