"""`python -m futx ...` is the `futx` command."""

from futx.cli import main

raise SystemExit(main())
