"""``python -m benchmarks.scale``: the metadata-at-scale simulation (see ``cli``)."""

import sys

from benchmarks.scale.cli import main

sys.exit(main())
