"""What a run tells its user: per-step records, failure events, measured transitions,
metrics and plots."""
