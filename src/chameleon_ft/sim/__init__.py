"""Discrete-event cluster simulator: failure traces replayed against every policy."""
