"""A private PostgreSQL cluster under ``infra.dir``: created once, started and stopped with ``pg_ctl``.

``initdb`` refuses to run as root, so as root the cluster belongs to an unprivileged system account
(``infra.os_user``, created if missing). The cluster listens on 127.0.0.1 only (its socket in its own folder), with
password authentication; the password is generated at creation and kept in a file only its owner reads.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path

from exitplan.config import InfraParams
from exitplan.errors import InfraError
from exitplan.infra.processes import uid_gid

ROLE = "exitplan"
"""The database role the services connect as (the cluster's superuser)."""

DATABASES = ("prefect", "mlflow")
"""The databases of the profile: one per server."""


def folder(state: Path) -> Path:
    """The cluster's folder: ``data/`` (the cluster), ``run/`` (its socket), ``postgres.log``."""
    return state / "postgres"


def server_bin(settings: InfraParams) -> Path:
    """The folder of ``initdb`` and ``pg_ctl``.

    Raises:
        InfraError: if PostgreSQL's server programs are not installed.
    """
    if settings.postgres_bin:
        found = Path(settings.postgres_bin)
    else:
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name)
                          if p.parent.name.isdigit() else 0)
        on_path = shutil.which("pg_ctl")
        found = versions[-1] if versions else Path(on_path).parent if on_path else Path("/usr/lib/postgresql")
    if not (found / "pg_ctl").is_file() or not (found / "initdb").is_file():
        raise InfraError(f"no PostgreSQL server programs (initdb, pg_ctl) in {found}: install them (Debian: "
                         f"`apt-get install postgresql`) or set infra.postgres_bin")
    return found


def owner(settings: InfraParams) -> str | None:
    """The account the cluster runs as: ``infra.os_user`` when this process is root, else None (this user)."""
    return settings.os_user if os.geteuid() == 0 else None


def _as_owner(argv: list[str], user: str | None) -> list[str]:
    return ["runuser", "-u", user, "--", *argv] if user else argv


def _ensure_user(user: str) -> None:
    import pwd

    try:
        pwd.getpwnam(user)
    except KeyError:
        _run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user], f"create user {user}")


def _run(argv: list[str], what: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise InfraError(f"{what} failed (exit {result.returncode}): {(result.stdout + result.stderr).strip()}")
    return result.stdout


def password(state: Path) -> str:
    """The role's password (generated when the cluster was created).

    Raises:
        InfraError: if the cluster was never created.
    """
    path = folder(state) / "password"
    if not path.is_file():
        raise InfraError(f"no PostgreSQL cluster under {folder(state)}: run `exitplan infra up` first")
    return path.read_text().strip()


def url(state: Path, settings: InfraParams, database: str, driver: str) -> str:
    """The SQLAlchemy URL of ``database`` (``driver``: ``asyncpg`` for Prefect, ``psycopg2`` for MLflow)."""
    return f"postgresql+{driver}://{ROLE}:{password(state)}@127.0.0.1:{settings.postgres_port}/{database}"


def create(state: Path, settings: InfraParams) -> bool:
    """Create the cluster if it does not exist yet.

    Returns:
        Whether it was created now.
    """
    home = folder(state)
    if (home / "data" / "PG_VERSION").is_file():
        return False
    programs, user = server_bin(settings), owner(settings)
    if user:
        _ensure_user(user)
    shutil.rmtree(home / "data", ignore_errors=True)  # a half-made cluster of an interrupted run
    for sub in ("data", "run"):
        (home / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    secret = secrets.token_urlsafe(24)
    pwfile = home / ".pwfile"
    pwfile.write_text(secret + "\n")
    uid, gid = uid_gid(user)
    for path in (home, home / "data", home / "run", pwfile):
        os.chown(path, uid, gid)
    os.chmod(pwfile, 0o600)
    if user and subprocess.run(_as_owner(["test", "-r", str(pwfile)], user), check=False).returncode != 0:
        pwfile.unlink(missing_ok=True)
        raise InfraError(f"{home} is out of reach of the account {user} that PostgreSQL runs as (a parent folder "
                         f"denies it entry): set infra.dir to a folder whose parents all allow others in (o+x)")
    try:
        _run(_as_owner([str(programs / "initdb"), "-D", str(home / "data"), "-U", ROLE, "--pwfile", str(pwfile),
                        "--auth=scram-sha-256", "-E", "UTF8", "--no-locale"], user), "initdb")
    finally:
        pwfile.unlink(missing_ok=True)
    (home / "password").write_text(secret + "\n")
    os.chmod(home / "password", 0o600)
    return True


def start(state: Path, settings: InfraParams) -> None:
    """Start the cluster (``pg_ctl start -w``: returns once it accepts connections); a no-op if it runs."""
    home, programs, user = folder(state), server_bin(settings), owner(settings)
    if running(state, settings):
        return
    options = (f"-c listen_addresses=127.0.0.1 -p {settings.postgres_port} "
               f"-c unix_socket_directories={home / 'run'}")
    _run(_as_owner([str(programs / "pg_ctl"), "-D", str(home / "data"), "-l", str(home / "postgres.log"), "-w",
                    "-t", str(int(settings.startup_timeout_s)), "-o", options, "start"], user),
         f"PostgreSQL start on 127.0.0.1:{settings.postgres_port} (log: {home / 'postgres.log'})")


def running(state: Path, settings: InfraParams) -> bool:
    """Whether the cluster runs (``pg_ctl status``)."""
    home = folder(state)
    if not (home / "data" / "PG_VERSION").is_file():
        return False
    argv = _as_owner([str(server_bin(settings) / "pg_ctl"), "-D", str(home / "data"), "status"], owner(settings))
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def stop(state: Path, settings: InfraParams) -> bool:
    """Stop the cluster (fast shutdown: open sessions are ended, nothing committed is lost).

    Returns:
        Whether it was running.
    """
    if not running(state, settings):
        return False
    home = folder(state)
    _run(_as_owner([str(server_bin(settings) / "pg_ctl"), "-D", str(home / "data"), "-m", "fast", "-w", "stop"],
                   owner(settings)), "PostgreSQL stop")
    return True


def ensure_databases(state: Path, settings: InfraParams) -> None:
    """Create the profile's databases if missing, with ``pg_trgm`` in Prefect's (its server needs it)."""
    import psycopg2

    def connect(database: str):  # noqa: ANN202 - psycopg2 has no type stubs
        return psycopg2.connect(host="127.0.0.1", port=settings.postgres_port, user=ROLE, password=password(state),
                                dbname=database, connect_timeout=10)

    admin = connect("postgres")
    admin.autocommit = True
    try:
        with admin.cursor() as cursor:
            for name in DATABASES:
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cursor.fetchone() is None:
                    cursor.execute(f'CREATE DATABASE "{name}"')
    finally:
        admin.close()
    prefect = connect("prefect")
    prefect.autocommit = True
    try:
        with prefect.cursor() as cursor:
            cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    finally:
        prefect.close()
