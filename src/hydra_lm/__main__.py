"""``python -m hydra_lm`` runs the ``hydra-lm`` command line."""

import sys

from .cli import main

sys.exit(main())
