"""The durable adapter registry: tables (`models`), database access (`db`), and the adapter repository.

The registry is the source of truth for what can be served: an adapter registered here is servable by
name on every replica that shares the database, at once and after restarts.
"""
