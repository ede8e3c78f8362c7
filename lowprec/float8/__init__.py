"""lowprec's FP8 linear: per-role formats and scalings, GEMM backends, FP8 activation caching."""

from lowprec.float8.config import LinearFP8Config, RoleConfig, linear_config
from lowprec.float8.gemm import fp8_gemm
from lowprec.float8.linear import Float8Linear

__all__ = ["Float8Linear", "LinearFP8Config", "RoleConfig", "fp8_gemm", "linear_config"]
