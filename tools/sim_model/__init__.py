"""Simulation assets: a tiny GLM-family checkpoint made locally and a local Hugging Face endpoint.

Run from the repository root:

    python -m tools.sim_model.make_tiny_glm OUTDIR [--seed N]
    python -m tools.sim_model.serve_hub MODELS_DIR --workdir DIR [--port P]
"""
