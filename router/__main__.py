from __future__ import annotations

from router.cli import main

raise SystemExit(main())
