"""``python -m ckptstore`` is the ``ckpt`` command."""

from ckptstore.cli.app import main

raise SystemExit(main())
