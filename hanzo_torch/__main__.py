"""``python -m hanzo_torch``: the ``hanzo-torch`` command line (see :mod:`hanzo_torch.cli`)."""
import sys

from .cli import main

sys.exit(main())
