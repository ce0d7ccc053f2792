"""``python -m reshard.cli``: the ``reshard`` command."""

import sys

from reshard.cli import main

sys.exit(main())
