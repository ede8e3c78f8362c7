"""Command-line parts beside the runs: shell completion and ``lowprec data prepare``."""
