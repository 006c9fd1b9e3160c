"""Team accounts from the terminal (docs/team.md): `omni-studio users add|ls|remove|passwd`,
`omni-studio keys create|ls|revoke`, passwords and keys never in clear in the store, and `history ls`
carrying each run's owner (`--user NAME` filters). SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.register_assert_rewrite("conftest_store")

from conftest_store import resolved_request, success_events  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402

from engine.config import PipelineConfig  # noqa: E402
from studio.accounts.service import Accounts  # noqa: E402
from studio.cli import main  # noqa: E402
from studio.store import RunRecorder, open_store  # noqa: E402

pytest_plugins = ["conftest_store"]
PASSWORD = "correct horse battery staple"


def cli(capsys: pytest.CaptureFixture, db_url: str, data_dir: Path, *args: str) -> tuple[int, str, str]:
    code = main([*args, "--db", db_url, "--data-dir", str(data_dir)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "pw"
    path.write_text(PASSWORD + "\n")
    return path


def every_stored_text(db_url: str, data_dir: Path) -> str:
    """Every value of the accounts tables, as text (what anyone who copies the database can read)."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as connection:
            rows = [
                *connection.execute(text("SELECT * FROM users")).all(),
                *connection.execute(text("SELECT * FROM api_keys")).all(),
            ]
    finally:
        engine.dispose()
    dumped = " ".join(str(value) for row in rows for value in row)
    sqlite_file = data_dir / "runs.db"
    if db_url.startswith("sqlite") and sqlite_file.exists():
        dumped += sqlite_file.read_bytes().decode("latin-1")
    return dumped


def test_users_add_ls_passwd_remove(
    db_url: str, data_dir: Path, password_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out, _ = cli(
        capsys, db_url, data_dir, "users", "add", "alice", "--password-file", str(password_file)
    )
    assert (code, out.strip()) == (0, "added user alice")
    code, out, _ = cli(
        capsys, db_url, data_dir, "users", "add", "root", "--admin", "--password-file", str(password_file)
    )
    assert (code, out.strip()) == (0, "added user root (admin)")
    code, out, _ = cli(capsys, db_url, data_dir, "users", "ls", "--json")
    listed = json.loads(out)
    assert [(u["name"], u["admin"]) for u in listed] == [("alice", False), ("root", True)]
    assert PASSWORD not in out and "argon2" not in out

    # A second alice, a short password, no password at all: refused, naming why.
    code, _, err = cli(
        capsys, db_url, data_dir, "users", "add", "alice", "--password-file", str(password_file)
    )
    assert code == 2 and "exists already" in err
    short = tmp_path / "short"
    short.write_text("abc\n")
    code, _, err = cli(capsys, db_url, data_dir, "users", "add", "bob", "--password-file", str(short))
    assert code == 2 and "at least 8 characters" in err
    code, _, err = cli(
        capsys, db_url, data_dir, "users", "add", "bad name!", "--password-file", str(password_file)
    )
    assert code == 2

    # passwd: the old password stops working, the new one works.
    new = tmp_path / "new"
    new.write_text("a different passphrase\n")
    code, out, _ = cli(capsys, db_url, data_dir, "users", "passwd", "alice", "--password-file", str(new))
    assert code == 0 and "changed the password of alice" in out
    with open_store(db_url, data_dir) as store:
        accounts = Accounts(store)
        assert accounts.login("alice", PASSWORD) is None
        alice = accounts.login("alice", "a different passphrase")
        assert alice is not None and alice.name == "alice" and not alice.admin
        root = accounts.login("root", PASSWORD)
        assert root is not None and root.admin
        assert accounts.login("nobody", PASSWORD) is None

    code, out, _ = cli(capsys, db_url, data_dir, "users", "remove", "alice")
    assert code == 0 and "removed user alice" in out
    code, out, _ = cli(capsys, db_url, data_dir, "users", "ls")
    assert "alice" not in out and "root" in out
    code, _, err = cli(capsys, db_url, data_dir, "users", "remove", "alice")
    assert code == 2 and "no user named 'alice'" in err


def test_keys_create_ls_revoke_and_nothing_in_clear(
    db_url: str, data_dir: Path, password_file: Path, capsys: pytest.CaptureFixture
) -> None:
    cli(capsys, db_url, data_dir, "users", "add", "alice", "--password-file", str(password_file))
    code, out, _ = cli(capsys, db_url, data_dir, "keys", "create", "--user", "alice", "--name", "laptop")
    assert code == 0
    key = out.splitlines()[-1]  # the last line of stdout, for scripts
    assert key.startswith("omni_") and len(key) > 40
    code, out, _ = cli(capsys, db_url, data_dir, "keys", "ls", "--json")
    (listed,) = json.loads(out)
    assert listed["user"] == "alice" and listed["name"] == "laptop" and listed["revoked_at"] is None
    assert listed["id"] in key and key not in out  # the id is visible; the key is never shown again

    with open_store(db_url, data_dir) as store:
        accounts = Accounts(store)
        who = accounts.identify_key(key)
        assert who is not None and who.name == "alice"
        assert accounts.identify_key(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
        assert accounts.identify_key("not a key") is None

    # Neither the password nor the key is anywhere in the database, only their hashes.
    stored = every_stored_text(db_url, data_dir)
    assert PASSWORD not in stored and key not in stored and key.split("_", 2)[2] not in stored
    assert "$argon2id$" in stored

    code, _, err = cli(capsys, db_url, data_dir, "keys", "create", "--user", "nobody")
    assert code == 2 and "no user named 'nobody'" in err
    code, out, _ = cli(capsys, db_url, data_dir, "keys", "revoke", listed["id"])
    assert code == 0 and "revoked" in out
    with open_store(db_url, data_dir) as store:
        assert Accounts(store).identify_key(key) is None
    code, out, _ = cli(capsys, db_url, data_dir, "keys", "ls", "--user", "alice")
    assert listed["id"] in out and "REVOKED" in out
    code, _, err = cli(capsys, db_url, data_dir, "keys", "ls", "--user", "nobody")
    assert code == 2 and "--user: no user named 'nobody'" in err
    code, _, err = cli(capsys, db_url, data_dir, "keys", "revoke", "0000000000")
    assert code == 2 and "no API key" in err


def test_history_ls_carries_the_owner_and_filters_by_user(
    db_url: str, data_dir: Path, pipeline_config: PipelineConfig, capsys: pytest.CaptureFixture
) -> None:
    with open_store(db_url, data_dir) as store:
        recorder = RunRecorder(store)
        for prompt, user in (("alice's fox", "alice"), ("bob's owl", "bob"), ("nobody's cat", None)):
            resolved = resolved_request(prompt)
            tracker = recorder.start_run(
                "api", resolved, pipeline_config, "tiny-glm-image", None, {}, user=user
            )
            for event in success_events(resolved):
                tracker.observe(event)
            recorder.flush()
        recorder.close()
    code, out, _ = cli(capsys, db_url, data_dir, "history", "ls", "--json")
    owners = {run["prompt"]: run["owner"] for run in json.loads(out)}
    assert owners == {"alice's fox": "alice", "bob's owl": "bob", "nobody's cat": None}
    code, out, _ = cli(capsys, db_url, data_dir, "history", "ls", "--json", "--user", "bob")
    assert [run["prompt"] for run in json.loads(out)] == ["bob's owl"]
    code, out, _ = cli(capsys, db_url, data_dir, "history", "ls")
    assert "OWNER" in out.splitlines()[0] and "alice" in out
