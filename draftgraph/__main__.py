import sys

from draftgraph.cli import main

sys.exit(main())
