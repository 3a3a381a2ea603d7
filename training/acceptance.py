"""`python -m training.acceptance` where the README documents it; the code is training/serve/acceptance.py."""

import sys

from training.serve.acceptance import main

if __name__ == "__main__":
    sys.exit(main())
