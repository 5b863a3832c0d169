"""`python -m pdclient ...`: see pdclient._cli."""

import sys

from ._cli import main

sys.exit(main())
