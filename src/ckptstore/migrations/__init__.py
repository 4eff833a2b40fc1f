"""Alembic environment and revisions for the ckptstore catalog (shipped in the wheel)."""
