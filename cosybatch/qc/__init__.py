"""Quality control: per-clip signals, the ASR round-trip gate and the audit page (report.html)."""
