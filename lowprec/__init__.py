"""lowprec: mixed- and low-precision LLM training recipes, measured (docs/architecture.md)."""

from lowprec import _quiet

_quiet.install()
