"""Number formats and scaling: FP8/BF16/FP16 facts, exact quantize/dequantize, scale granularities and strategies.

The bottom of the precision core (``docs/architecture.md``): nothing here knows about models, recipes or runs.
"""
