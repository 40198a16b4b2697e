"""Secrets kept as files in a folder (a volume in compose), one value per file named like its
variable: `kvgate init-secrets` makes them once, every `kvgate` process reads them when
KVGATE_SECRETS_DIR names the folder. So `docker compose up` needs no exported secrets, and they
never appear in a compose file, an environment listing or a command line."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import quote

PREFIX = "KVGATE_"
REDIS_PASSWORD = "redis.password"  # for the Redis server itself, with redis.conf beside it


def load_into_env(folder: Path) -> list[str]:
    """Set each KVGATE_* variable that is unset or empty from its file; the names set."""
    loaded = []
    for path in sorted(folder.glob(f"{PREFIX}*")):
        if path.is_file() and not os.environ.get(path.name):
            os.environ[path.name] = path.read_text().strip()
            loaded.append(path.name)
    return loaded


def init_secrets(folder: Path, redis_host: str = "redis", redis_port: int = 6379) -> list[str]:
    """Write the secrets a stack needs into `folder` where absent (idempotent); the files written.
    The server secret, an admin key, a first user key, and Redis's password with the URL that
    carries it and a redis.conf that requires it."""
    folder.mkdir(parents=True, exist_ok=True)
    written = [name for name, make in [
        ("KVGATE_SECRET", lambda: secrets.token_urlsafe(32)),
        ("KVGATE_ADMIN_KEY", lambda: "sk-kvg-admin-" + secrets.token_urlsafe(24)),
        ("KVGATE_API_KEY", lambda: "sk-kvg-" + secrets.token_urlsafe(24)),
        (REDIS_PASSWORD, lambda: secrets.token_urlsafe(32)),
    ] if _create(folder / name, make, 0o600)]
    password = (folder / REDIS_PASSWORD).read_text().strip()
    url = f"redis://:{quote(password, safe='')}@{redis_host}:{redis_port}/0"
    written += [name for name, text, mode in [
        ("KVGATE_REDIS_URL", url, 0o600),
        # Redis runs as its own user: the one file it reads is readable by it (and only holds this)
        ("redis.conf", f"requirepass {password}", 0o644),
    ] if _create(folder / name, lambda text=text: text, mode)]
    return written


def _create(path: Path, make, mode: int) -> bool:
    """Write make() to `path` unless it is there already."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(make() + "\n")
    os.chmod(path, mode)
    return True
