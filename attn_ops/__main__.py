import sys

from attn_ops.cli import main

sys.exit(main())
