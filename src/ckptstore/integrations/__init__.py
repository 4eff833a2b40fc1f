"""ckptstore package."""
