import sys

from lowprec_lab.cli import main

sys.exit(main())
