"""`python -m futx.cli ...` is the `futx` command."""

from futx.cli import main

raise SystemExit(main())
