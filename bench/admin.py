"""Adapters registered and deleted through the server's admin API (Authorization: Bearer <admin key>).

POST /admin/adapters {"name", "path", "description"} -> 201 created, 409 already registered
DELETE /admin/adapters/{name}
"""

from __future__ import annotations

import httpx

from bench import BenchError
from bench.client import response_error


class AdminClient:
    def __init__(self, url: str, admin_key: str | None, timeout_s: float = 60.0):
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/").removesuffix("/v1"), headers=headers, timeout=timeout_s)

    def register(self, name: str, path: str, description: str = "") -> bool:
        """True if registered now, False if `name` was already registered."""
        response = self._call("POST", "/admin/adapters", json={"name": name, "path": path, "description": description})
        if response.status_code == 409:
            return False
        if response.status_code not in (200, 201):
            raise BenchError(
                f"registering adapter {name!r} at {path} failed: {response_error(response)}. The path must be a "
                "directory the server can read, under one of its allowed adapter roots (see --adapter-dir)"
            )
        return True

    def delete(self, name: str) -> None:
        response = self._call("DELETE", f"/admin/adapters/{name}")
        if response.status_code not in (200, 202, 204, 404):
            raise BenchError(f"deleting adapter {name!r} failed: {response_error(response)}")

    def close(self) -> None:
        self.client.close()

    def _call(self, method: str, path: str, **options) -> httpx.Response:
        try:
            response = self.client.request(method, path, **options)
        except httpx.HTTPError as e:
            raise BenchError(f"{method} {self.client.base_url}{path}: {type(e).__name__}: {e}") from e
        if response.status_code in (401, 403):
            raise BenchError(f"the server refused the admin key ({response_error(response)}); pass --admin-key")
        return response
