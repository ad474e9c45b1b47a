import sys

from bench.serve.run import main

sys.exit(main())
