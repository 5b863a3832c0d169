"""`python -m pdclient ...`: see pdclient.cli."""

import sys

from .cli import main

sys.exit(main())
