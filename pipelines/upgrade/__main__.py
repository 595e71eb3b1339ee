import sys

from pipelines.upgrade import main

sys.exit(main())
