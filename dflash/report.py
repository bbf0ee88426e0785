"""`python -m dflash.report`: the command of dflash/tools/report.py (kept short)."""

import sys

from dflash.tools.report import main

if __name__ == "__main__":
    sys.exit(main())
