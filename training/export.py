"""`python -m training.export` where the README documents it; the code is training/serve/export.py."""

import sys

from training.serve.export import main

if __name__ == "__main__":
    sys.exit(main())
