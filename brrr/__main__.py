import sys

from brrr.cli import main

sys.exit(main())
