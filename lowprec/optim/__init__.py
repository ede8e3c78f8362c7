"""Optimizer components: FP32 master weights, low-bit AdamW moments, update rounding, dynamic loss scaling.

``lowprec.optim.builder`` (which reads the recipe) builds them; it is not imported here so that these
components stay below the recipe layer (``lowprec.backends`` builds on them).
"""
