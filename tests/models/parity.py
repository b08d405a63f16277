"""The tolerance of every logit-parity test against Hugging Face ``transformers``."""

PARITY_TOL = 1e-6
"""Max absolute logit error against transformers (float32, CPU). Measured: a correct load is off
by 0.8-1.8e-7 (a few float32 ulps of logits of size 0.5) on the fixtures and on fresh seeds; the
smallest real mistake we know of, Llama loaded with rope_theta 10,000 instead of 500,000, is off
by 2.2-4.5e-5. 1e-6 sits between them, 5x above the one and 20x below the other;
``test_decoder_vs_reference`` holds each named mistake above it."""
