import sys

from bench.transfer.cli import main

sys.exit(main())
