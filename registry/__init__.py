"""The durable registry: tables (`models`), URLs and migrations (`db`), and one repository per table (`adapters`,
`tenants`, `api_keys`, `usage`), held together by `database.RegistryDatabase`. Every SQL statement lives here.

The registry is the source of truth for what can be served: an adapter registered here is servable by
name on every replica that shares the database, at once and after restarts.
"""
