"""The push/pull suite's stores and helpers (tests/remote_support.py, shared with the sync
flow's test in tests/flows/)."""

from remote_support import kit, pg_url, s3_a, s3_b, stores  # noqa: F401 - fixtures
