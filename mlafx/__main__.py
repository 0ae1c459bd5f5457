"""``python -m mlafx``: the ``mlafx`` command."""

import sys

from mlafx.cli import main

sys.exit(main())
