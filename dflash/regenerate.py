"""`python -m dflash.regenerate`: the command of dflash/data/regenerate.py (kept short)."""

import sys

from dflash.data.regenerate import main

if __name__ == "__main__":
    sys.exit(main())
