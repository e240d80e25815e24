"""``python -m zerostack.launcher ...`` is ``zerostack launch ...``."""

import sys

from .runner import main

sys.exit(main())
