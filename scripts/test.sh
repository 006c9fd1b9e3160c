#!/usr/bin/env bash
# Install what the tests need (from nothing) and run the whole suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh test
# The habits: lint, format and types (config in pyproject.toml; see CONTRIBUTING.md).
# OMNI_STUDIO_SKIP_CHECKS=1 skips them for a quick local pytest run; CI always runs them.
if [ -z "${OMNI_STUDIO_SKIP_CHECKS:-}" ]; then
  echo "[test] ruff check, ruff format --check, mypy" >&2
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  .venv/bin/mypy
fi

export OMNI_STUDIO_TEST_MODEL_CACHE="${OMNI_STUDIO_TEST_MODEL_CACHE:-$root/.venv/omni-test-models}"

# A throwaway PostgreSQL server for the run store's tests (the same tests run on SQLite and on it).
# Postgres refuses to run as root, so as root (CI) the server runs as `nobody` in a temp dir it owns.
# A server given by the caller (OMNI_STUDIO_TEST_PG_URL already set) is used as is.
if [ -z "${OMNI_STUDIO_TEST_PG_URL:-}" ]; then
  pg_bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
  [ -x "$pg_bin/initdb" ] || { echo "PostgreSQL is not installed (run scripts/setup.sh test)" >&2; exit 1; }
  pg_tmp="$(mktemp -d /tmp/omni-test-pg.XXXXXX)"
  as_pg=()
  if [ "$(id -u)" = 0 ]; then chown nobody "$pg_tmp"; as_pg=(env -C "$pg_tmp" runuser -u nobody --); fi
  pg_port="$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  stop_pg() {
    "${as_pg[@]}" "$pg_bin/pg_ctl" stop -D "$pg_tmp/data" -m fast -s >/dev/null 2>&1 || true
    rm -rf "$pg_tmp"
  }
  trap stop_pg EXIT
  "${as_pg[@]}" "$pg_bin/initdb" -D "$pg_tmp/data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$pg_tmp/initdb.log" 2>&1 \
    || { cat "$pg_tmp/initdb.log" >&2; exit 1; }
  "${as_pg[@]}" "$pg_bin/pg_ctl" start -D "$pg_tmp/data" -l "$pg_tmp/server.log" -w -s \
    -o "-c listen_addresses=127.0.0.1 -p $pg_port -k $pg_tmp -c fsync=off -c max_connections=200" \
    || { cat "$pg_tmp/server.log" >&2; exit 1; }
  "$pg_bin/createdb" -h 127.0.0.1 -p "$pg_port" -U postgres omni_test
  export OMNI_STUDIO_TEST_PG_URL="postgresql+psycopg://postgres@127.0.0.1:$pg_port/omni_test"
  echo "[test] PostgreSQL $("$pg_bin/postgres" --version | awk '{print $3}') on 127.0.0.1:$pg_port (data in $pg_tmp)" >&2
fi

# Not exec: the EXIT trap above must still stop the PostgreSQL server.
status=0
.venv/bin/python -m pytest -q -ra -m "not ray" "$@" || status=$?

# The Ray tests (marker `ray`) start a Ray cluster, and Ray binds every interface and talks over the
# machine's own address: they run in a network namespace with nothing but loopback (docs/distributed.md),
# as a second pytest run (the PostgreSQL server above is not reachable in there; they do not use it).
ray_status=0
if unshare -n true 2>/dev/null; then
  echo "[test] the Ray tests, in a loopback-only network namespace (unshare -n)" >&2
  unshare -n sh -c 'ip link set lo up && exec "$@"' sh \
    .venv/bin/python -m pytest -q -ra -m ray "$@" || ray_status=$?
elif [ -n "${CI:-}" ]; then
  echo "[test] cannot create a network namespace (unshare -n needs root): CI must run the Ray tests" >&2
  ray_status=1
else
  echo "[test] skipping the Ray tests: 'unshare -n' needs root (run scripts/test.sh as root to include them)" >&2
fi
# pytest's 5 (nothing selected) is fine for one run when the other ran tests: arguments may pick only one kind.
if [ "$status" = 5 ] && [ "$ray_status" != 5 ]; then status=0; fi
if [ "$ray_status" = 5 ] && [ "$status" = 0 ]; then ray_status=0; fi
[ "$status" = 0 ] || exit "$status"
exit "$ray_status"
