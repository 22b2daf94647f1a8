"""EXL3 (exllamav3) weights: exact PyTorch decoder and the vLLM quantization method built on it."""
