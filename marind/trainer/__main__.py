import sys

from marind.trainer.main import main

sys.exit(main())
