"""The experiment runner: Hydra entry points, MLflow tracking, ablations and reports."""
