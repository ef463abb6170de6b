"""`python -m mapoffload` is the `mapoffload` command."""

from .cli import main

raise SystemExit(main())
