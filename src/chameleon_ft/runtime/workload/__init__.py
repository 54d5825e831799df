"""What the user hands over: the layered model (``models``), the data (``data``), the
optimizer and its schedule (``optim``), the numerics (``precision``), sealed together for
the workers (``bundle``); the API (``api``) and the single-process reference trainer
(``reference``) the runtime's results are checked against.

Importing this package does not import torch; its modules do.
"""
