"""Optimizer components: FP32 master weights, low-bit AdamW moments, update rounding, dynamic loss scaling.

``lowprec.build_optim`` (build layer: it reads the recipe) builds them; these components know nothing of recipes
(``lowprec.backends`` builds on them).
"""
