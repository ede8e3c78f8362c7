"""The runner: trains one run, schedules an ablation's runs, resumes it, reaps orphans and injects faults."""
