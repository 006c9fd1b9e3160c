"""Alembic environment for the run store: always run from code, on a connection the store hands in.

``RunStore`` opens the connection (with its SQLite pragmas and a write lock) and passes it as
``config.attributes["connection"]``; there is no ``alembic.ini`` and no offline (SQL script) mode.
"""

from __future__ import annotations

from alembic import context

from studio.store.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run store migrations run through studio.store.migrate(), which supplies a connection")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table where needed.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
