"""The report: builds an ablation's verdict table, plots, markdown and HTML from its tracked runs."""
