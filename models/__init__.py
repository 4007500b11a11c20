"""Flax NNX decoders (Llama, Qwen2/2.5, Qwen3) with HF checkpoint import/export.

The model layer arrives with the models issue; the package exists so that the distribution's
layout is fixed from the start.
"""
