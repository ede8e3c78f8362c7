"""Start-up between the door and the first run: the process group, the data (rank 0 first), corpus tags."""
