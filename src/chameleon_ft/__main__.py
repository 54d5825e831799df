"""``python -m chameleon_ft`` runs the ``chameleon`` command."""

import sys

from chameleon_ft.cli import main

sys.exit(main())
