"""``python -m autopar.cli``: the ``autopar`` command."""

import sys

from . import main

sys.exit(main())
