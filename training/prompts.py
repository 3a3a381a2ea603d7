"""`python -m training.prompts` where the README documents it; the code is training/data/prompts.py."""

import sys

from training.data.prompts import main

if __name__ == "__main__":
    sys.exit(main())
