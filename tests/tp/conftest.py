import os
import sys

# tp_helpers sits beside the tests; spawned TP workers never import it.
sys.path.insert(0, os.path.dirname(__file__))
