"""Tracking: the MLflow tracker, the offline spool and its sync, the UI, and the logs and runs read back from it."""
