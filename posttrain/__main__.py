import sys

from posttrain.apps.cli import main

sys.exit(main())
