"""Alembic migrations of the registry database (`loraplex db upgrade`, and at every `loraplex serve` start)."""
