"""SqliteDataVersion: whether any connection, in any process, has committed to a SQLite registry since the last
look, read in microseconds without a query through the connection pool.

SQLite's `PRAGMA data_version` on one connection of our own changes whenever another connection commits; reading it
checks the file's change counter, no SQL through SQLAlchemy, no worker-thread hop. That makes it cheap enough to
ask on every request, so resolved adapters can be kept between requests and still never be served stale: a
delete or re-register by this process or by a replica sharing the file is seen by the very next request.
PostgreSQL has no such counter (NOTIFY arrives late, a query costs what the lookup costs): no marker there.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from sqlalchemy import URL, make_url

logger = logging.getLogger(__name__)


class SqliteDataVersion:
    def __init__(self, path: Path):
        self.path = path
        self._connection: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def read(self) -> int | None:
        """The current data version, or None when it cannot be read right now (a writer holds the file)."""
        with self._lock:
            try:
                if self._connection is None:  # opened on first use: the file exists once migrated
                    uri = f"{self.path.resolve().as_uri()}?mode=rw"  # never creates the file
                    self._connection = sqlite3.connect(uri, uri=True, timeout=0, check_same_thread=False)
                return self._connection.execute("PRAGMA data_version").fetchone()[0]
            except sqlite3.Error as e:  # locked, or not there yet: the caller reads the database instead
                logger.debug("registry data_version unreadable (%s): looking adapters up in the database", e)
                return None

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None


def change_marker(url: str | URL) -> SqliteDataVersion | None:
    """A marker for a SQLite file database; None for anything else (PostgreSQL, in-memory SQLite)."""
    url = make_url(url)
    database = url.database
    if url.get_backend_name() != "sqlite" or not database or database == ":memory:" or "mode=memory" in str(url):
        return None
    return SqliteDataVersion(Path(database).expanduser())
