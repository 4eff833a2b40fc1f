"""Test utilities shipped with ckptstore (fault injection, invariant checks)."""
