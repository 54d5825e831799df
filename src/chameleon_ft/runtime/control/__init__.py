"""The control plane, pure: the run's state and the rules that move it.

No torch, no store, no clock: every function takes what it needs and returns values, so
each rule is tested with tables of observations in and effects out (docs/design.md 4.1).
"""
