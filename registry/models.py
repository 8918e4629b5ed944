"""The registry's tables: adapters (name@version) and their files (by content digest), tenants, their API keys
(hashed), usage rollups and the outcomes of usage flushes.

SQLAlchemy 2.0 declarative models; the schema itself is created and changed only by Alembic
(`migrations/`), never by `create_all`, so a PostgreSQL shared by many replicas and a local SQLite file
evolve the same way.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    JSON,
    BigInteger,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

PUBLIC = None  # Adapter.owner for an adapter every tenant may use
INTEGER_MAX = 2**31 - 1  # the largest value an Integer column holds on PostgreSQL
BIGINT_MAX = 2**63 - 1  # ... a BigInteger column (and any SQLite INTEGER)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    description: Mapped[str | None] = mapped_column(Text)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    token_quota: Mapped[int | None] = mapped_column(BigInteger)  # prompt + completion tokens per quota_period
    quota_period: Mapped[str] = mapped_column(String(8), default="day")  # "day" | "month"
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")  # share under fair scheduling
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow, server_default=func.now())


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))  # the first characters, to tell keys apart in listings
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow, server_default=func.now())
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("name", "version", name="uq_adapters_name_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    version: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(Text)  # resolved, under an allowed root
    base_model: Mapped[str] = mapped_column(String(256))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column()
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    digest: Mapped[str] = mapped_column(String(80))  # "sha256:..." over the weights: content identity
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default="ready")
    owner: Mapped[str | None] = mapped_column(
        ForeignKey("tenants.name", ondelete="CASCADE"), index=True
    )  # None: public
    description: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow, server_default=func.now())
    updated_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow, server_default=func.now()
    )

    @property
    def adapter_id(self) -> str:
        """The registry key the engine sees: name@version."""
        return f"{self.name}@{self.version}"


class AdapterFile(Base):
    """One file of a registered adapter's PEFT directory, under the adapter's content digest (shared by every
    name@version with the same weights)."""

    __tablename__ = "adapter_files"

    digest: Mapped[str] = mapped_column(String(80), primary_key=True)
    filename: Mapped[str] = mapped_column(String(255), primary_key=True)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow, server_default=func.now())


class UsageRollup(Base):
    """Tokens served per (tenant, adapter, day); "" stands for no tenant (auth off) and for the base model."""

    __tablename__ = "usage_rollups"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    adapter: Mapped[str] = mapped_column(String(200), primary_key=True)  # adapter name, "" = the base model
    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class UsageFlush(Base):
    """One Redis usage flush's outcome, keyed by its flush_id: written by the flusher in the transaction that adds
    its counters ("committed"), or by a reclaimer that found the flush abandoned ("abandoned"). The primary key
    decides which came first, so a flush's counters reach `usage_rollups` once or go back to pending, never both."""

    __tablename__ = "usage_flushes"

    flush_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    outcome: Mapped[str] = mapped_column(String(16))  # "committed" | "abandoned"
    created_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, server_default=func.now(), index=True
    )
