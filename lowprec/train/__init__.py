"""Build step and training loop."""
