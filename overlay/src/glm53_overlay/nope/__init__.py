"""NoPE MLA: serve an MLA model without a RoPE part (qk_rope_head_dim 0, GLM-5.3 Flash) on vLLM kernels
that only know the 512 + 64 = 576 latent geometry, by padding the rope part with zeros.

Zeros add exactly nothing to q·k (q_pe·k_pe = 0) and the values come from the 512-wide latent only, so
the padded kernels compute the NoPE attention unchanged; the cost is 64 wasted rope slots per cached token.
"""
