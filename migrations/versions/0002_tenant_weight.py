"""tenants.weight: a tenant's share of the engine under --scheduling-policy fair

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("weight", sa.Float(), server_default="1", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("weight")
