"""`python -m kvserve ...`: the same as the `kvserve` command."""
import sys

from kvserve.cli import main

sys.exit(main())
