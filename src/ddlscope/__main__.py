import sys

from ddlscope.cli import main

sys.exit(main())
