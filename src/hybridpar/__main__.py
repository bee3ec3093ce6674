import sys

from hybridpar.cli import main

sys.exit(main())
