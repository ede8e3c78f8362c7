"""The plan: the configuration schema, preflight checks, start-up, launch and shell completion of a run or ablation."""
