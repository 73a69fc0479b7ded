import sys

from marind.cli import main

sys.exit(main())
