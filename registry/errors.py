"""How a failed registry call reads to the caller: the database's own errors sorted into "unavailable" (the
database is down, unreachable, emptied, not migrated: retry later) and the few that are the caller's input.

The gateway turns `UNAVAILABLE` into a 503 with Retry-After, so that an outage never looks like a bug (500).
"""

from __future__ import annotations

from sqlalchemy import exc

# A value the database refused (too long for its column, out of range): the request's problem.
BAD_VALUE: tuple[type[Exception], ...] = (exc.DataError,)
# Everything else the driver raises, and a connection pool that waited too long: the database's problem.
UNAVAILABLE: tuple[type[Exception], ...] = (
    exc.OperationalError,  # down, unreachable, locked, no such table (SQLite), disk full
    exc.ProgrammingError,  # no such table / column (PostgreSQL): an emptied or unmigrated database
    exc.InterfaceError,
    exc.InternalError,
    exc.NotSupportedError,
    exc.TimeoutError,  # the connection pool had nothing to give
)


def describe(error: Exception) -> str:
    """One line naming the failure without the SQL statement or its parameters (no data leaks to a client)."""
    original = getattr(error, "orig", None) or error
    text = str(original).strip().splitlines()[0] if str(original).strip() else ""
    return f"{type(original).__name__}: {text}"[:200] if text else type(original).__name__
