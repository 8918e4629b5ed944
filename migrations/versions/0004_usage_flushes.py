"""usage_flushes: each Redis usage flush's outcome by flush_id, so a flush whose gateway died while committing is
resolved (its counters kept or given back) instead of lost

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "usage_flushes",
        sa.Column("flush_id", sa.String(64), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("flush_id"),
    )
    op.create_index("ix_usage_flushes_created_at", "usage_flushes", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_flushes_created_at", table_name="usage_flushes")
    op.drop_table("usage_flushes")
