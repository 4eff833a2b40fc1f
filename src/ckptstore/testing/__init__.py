"""Test utilities shipped with ckptstore (fault injection, invariant checks, S3 and port
helpers)."""
