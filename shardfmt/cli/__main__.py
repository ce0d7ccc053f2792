"""``python -m shardfmt.cli``: the ``shardfmt`` command."""

import sys

from shardfmt.cli import main

sys.exit(main())
