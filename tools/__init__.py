"""Instruments and checkpoint converters, run as `python -m tools.NAME` from the repository root
(DESIGN.md).

  python -m tools.gguf_to_hf --out checkpoints/SmolLM2-135M-Instruct
"""
