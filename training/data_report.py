"""`python -m training.data_report` where the README documents it; the code is training/data/report.py."""

import sys

from training.data.report import main

if __name__ == "__main__":
    sys.exit(main())
